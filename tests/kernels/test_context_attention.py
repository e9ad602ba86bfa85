"""context_attention_fwd: Triton vs twin, and twin vs SDPA on dense gathered K/V."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICE_DTYPES, alibi_slopes, i32, make_paged_kv, randn, rng, run_poisoned, tol

from llmserve.kernels.context_attention import context_attention_fwd_torch, context_attention_fwd_triton

# (Hq, Hkv, D, cached_lens, q_lens, alibi)
CASES = [
    pytest.param(2, 2, 64, [0, 0, 0], [1, 7, 33], False, id="mha-d64-prefill"),
    pytest.param(4, 2, 128, [5, 0, 17], [7, 33, 1], False, id="gqa-d128-cached"),
    pytest.param(4, 2, 32, [3, 20], [16, 9], True, id="gqa-d32-cached-alibi"),
    pytest.param(2, 2, 64, [0, 31], [33, 2], True, id="mha-d64-alibi"),
    pytest.param(4, 1, 64, [40, 1], [3, 18], False, id="mqa-d64-verify"),
]


def make_inputs(seed: int, Hq: int, Hkv: int, D: int, cached: list[int], q_lens: list[int],
                alibi: bool, dtype: torch.dtype, device: str) -> dict:
    g = rng(seed)
    kv = make_paged_kv(g, [c + n for c, n in zip(cached, q_lens)], Hkv, D, dtype, device)
    total_q = sum(q_lens)
    # Requests' query rows are packed in an order different from the batch order.
    order = torch.randperm(len(q_lens), generator=g).tolist()
    q_start = [0] * len(q_lens)
    row = 0
    for i in order:
        q_start[i] = row
        row += q_lens[i]
    return dict(
        q=randn(g, total_q, Hq, D, dtype=dtype, device=device),
        k_cache=kv.k_cache, v_cache=kv.v_cache, req_to_token=kv.req_to_token, b_req_idx=kv.b_req_idx,
        b_q_start=i32(q_start, device), b_q_len=i32(q_lens, device), b_cached_len=i32(cached, device),
        max_q_len=max(q_lens), alibi_slopes=alibi_slopes(Hq, device) if alibi else None, _kv=kv,
    )


def sdpa_reference(inputs: dict, sm_scale: float | None = None) -> torch.Tensor:
    """Dense per-request attention through torch's SDPA with an explicit causal(+ALiBi) mask."""
    q, kv, slopes = inputs["q"], inputs["_kv"], inputs["alibi_slopes"]
    Hq = q.shape[1]
    out = torch.full_like(q, float("nan"), dtype=torch.float64)
    for i, (start, n, cached) in enumerate(zip(inputs["b_q_start"].tolist(), inputs["b_q_len"].tolist(),
                                                inputs["b_cached_len"].tolist())):
        k, v = kv.dense(i, Hq)  # [Hq, L, D]
        qi = q[start:start + n].double().transpose(0, 1)  # [Hq, n, D]
        rel = (torch.arange(cached + n, device=q.device)[None, :]
               - torch.arange(cached, cached + n, device=q.device)[:, None]).double()
        bias = torch.zeros(Hq, n, cached + n, dtype=torch.float64, device=q.device)
        if slopes is not None:
            bias = bias + slopes.double()[:, None, None] * rel
        bias = bias.masked_fill(rel > 0, float("-inf"))
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=bias, scale=sm_scale)
        out[start:start + n] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("Hq,Hkv,D,cached,q_lens,alibi", CASES)
def test_twin_matches_sdpa(Hq, Hkv, D, cached, q_lens, alibi):
    inputs = make_inputs(0, Hq, Hkv, D, cached, q_lens, alibi, torch.float32, "cpu")
    got = run_poisoned(context_attention_fwd_torch, inputs)
    torch.testing.assert_close(got.double(), sdpa_reference(inputs), atol=1e-5, rtol=1e-5)


def test_twin_sm_scale_and_longer_sequences():
    inputs = make_inputs(1, 8, 2, 64, [100, 0, 7], [60, 130, 1], True, torch.float32, "cpu")
    scale = 0.3 / math.sqrt(64)
    got = run_poisoned(context_attention_fwd_torch, inputs, sm_scale=scale)
    torch.testing.assert_close(got.double(), sdpa_reference(inputs, sm_scale=scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D,cached,q_lens,alibi", CASES)
def test_triton_matches_twin(device, dtype, Hq, Hkv, D, cached, q_lens, alibi):
    inputs = make_inputs(2, Hq, Hkv, D, cached, q_lens, alibi, dtype, device)
    want = run_poisoned(context_attention_fwd_torch, inputs)
    assert not want.isnan().any()
    # Small tiles: the short test sequences still span several query and key blocks.
    got = run_poisoned(context_attention_fwd_triton, inputs, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, **tol(dtype))


# The wrapper picks 16-, 32- or 128-row query tiles from max_q_len: cover each.
@pytest.mark.parametrize("cached,q_lens", [([70, 5], [1, 4]), ([70, 0], [3, 40]), ([70, 0], [9, 150])],
                         ids=["tile16", "tile32", "tile128"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_triton_default_blocks_and_sm_scale(device, dtype, D, cached, q_lens):
    inputs = make_inputs(3, 4, 2, D, cached, q_lens, True, dtype, device)
    want = run_poisoned(context_attention_fwd_torch, inputs, sm_scale=0.05)
    got = run_poisoned(context_attention_fwd_triton, inputs, sm_scale=0.05)
    torch.testing.assert_close(got, want, **tol(dtype))


def test_alibi_and_cache_change_the_result():
    """Guards against vacuous passes: ALiBi and the cached prefix must both matter."""
    base = make_inputs(4, 2, 2, 32, [10], [5], False, torch.float32, "cpu")
    with_alibi = dict(base, alibi_slopes=alibi_slopes(2, "cpu"))
    no_cache = dict(base, b_cached_len=i32([0], "cpu"))
    o = run_poisoned(context_attention_fwd_torch, base)
    assert not torch.allclose(o, run_poisoned(context_attention_fwd_torch, with_alibi), atol=1e-3)
    assert not torch.allclose(o, run_poisoned(context_attention_fwd_torch, no_cache), atol=1e-3)
