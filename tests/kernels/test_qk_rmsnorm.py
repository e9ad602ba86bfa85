"""qk_rmsnorm_: Triton against the twin, on q and k as the strided views of a fused qkv output
that Qwen3's layer hands it (v and anything past it left alone)."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, randn, rng, tol

from llmserve.kernels.qk_rmsnorm import qk_rmsnorm_torch_, qk_rmsnorm_triton_
from llmserve.kernels.rmsnorm import rmsnorm_forward_torch

# (tokens, q heads, kv heads, head_dim): powers of two; heads and a head_dim that are not
SHAPES = [(1, 4, 2, 16), (3, 6, 3, 24)]


def qkv_views(n, Hq, Hk, D, dtype, device, seed):
    """A qkv projection's output (with a few spare columns) and its q, k, v views."""
    g = rng(seed)
    qkv = randn(g, n, (Hq + 2 * Hk) * D + 5, dtype=dtype, device=device, scale=3.0)
    q = qkv[:, : Hq * D].view(n, Hq, D)
    kv = qkv[:, Hq * D: (Hq + 2 * Hk) * D].view(n, 2 * Hk, D)
    return qkv, q, kv[:, :Hk]


@pytest.mark.parametrize("round_first", [True, False], ids=["llama", "gemma"])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_twin_in_place(device, dtype, shape, round_first):
    n, Hq, Hk, D = shape
    qkv, q, k = qkv_views(*shape, dtype, device, seed=sum(shape))
    g = rng(D)
    wq, wk = randn(g, D, dtype=dtype, device=device), randn(g, D, dtype=dtype, device=device)
    if not round_first:  # Gemma's weights: the fp32 1 + w
        wq, wk = 1.0 + wq.float(), 1.0 + wk.float()
    want_qkv, want_q, want_k = qkv_views(*shape, dtype, device, seed=sum(shape))
    qk_rmsnorm_torch_(want_q, want_k, wq, wk, 1e-6, round_first)
    # the twin is the two norms HF runs, written back
    torch.testing.assert_close(want_q, rmsnorm_forward_torch(q, wq, 1e-6, round_first), atol=0, rtol=0)
    torch.testing.assert_close(want_k, rmsnorm_forward_torch(k, wk, 1e-6, round_first), atol=0, rtol=0)
    qk_rmsnorm_triton_(q, k, wq, wk, 1e-6, round_first)
    torch.testing.assert_close(qkv, want_qkv, **tol(dtype))
    qk_end = (Hq + Hk) * D
    assert torch.equal(qkv[:, qk_end:], want_qkv[:, qk_end:])  # v and the spare columns untouched
