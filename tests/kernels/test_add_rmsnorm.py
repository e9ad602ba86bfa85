"""add_rmsnorm_forward: twin vs HF (residual add, then LlamaRMSNorm), Triton vs twin."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, randn, rng, tol
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from llmserve.kernels.add_rmsnorm import add_rmsnorm_forward_torch, add_rmsnorm_forward_triton
from llmserve.kernels.rmsnorm import rmsnorm_forward_triton

SHAPES = [(1, 64), (5, 100), (3, 4096), (2, 5000)]  # 5000 > one 4096 block: chunked rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,N", SHAPES)
def test_twin_matches_hf(n, N, dtype):
    g = rng(N)
    h = randn(g, n, N, dtype=dtype, device="cpu", scale=3.0)
    delta = randn(g, n, N, dtype=dtype, device="cpu")
    norm = LlamaRMSNorm(N, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(g, N, dtype=dtype, device="cpu"))
        residual = h + delta                    # as HF's decoder layer: hidden = residual + attn_out
        want = norm(residual)
    got = add_rmsnorm_forward_torch(h, delta, norm.weight.detach(), 1e-5)
    torch.testing.assert_close(h, residual, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("round_first", [True, False], ids=["llama", "gemma"])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,N", SHAPES)
def test_triton_matches_twin(device, dtype, n, N, round_first):
    g = rng(N + 1)
    h = randn(g, n, N, dtype=dtype, device=device, scale=3.0)
    delta = randn(g, n, N, dtype=dtype, device=device)
    w = randn(g, N, dtype=dtype, device=device)
    if not round_first:   # Gemma's weight: the fp32 1 + w
        w = 1.0 + w.float()
    h_twin = h.clone()
    want = add_rmsnorm_forward_torch(h_twin, delta, w, 1e-6, round_first)
    got = add_rmsnorm_forward_triton(h, delta, w, 1e-6, round_first)
    assert got.dtype == dtype and got.shape == h.shape
    torch.testing.assert_close(h, h_twin, atol=0, rtol=0)       # the residual: one rounded add, both ways
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,N", SHAPES)
def test_triton_is_an_add_then_the_rmsnorm_kernel_bitwise(device, dtype, n, N):
    """The layers fuse each residual add into the next norm: that must not change a bit of what
    ``h += delta`` followed by the plain RMSNorm kernel gives (same ops in the same order)."""
    g = rng(N + 2)
    h = randn(g, n, N, dtype=dtype, device=device, scale=3.0)
    delta = randn(g, n, N, dtype=dtype, device=device)
    w = randn(g, N, dtype=dtype, device=device)
    h_plain = h.clone().add_(delta)
    want = rmsnorm_forward_triton(h_plain, w, 1e-6)
    got = add_rmsnorm_forward_triton(h, delta, w, 1e-6)
    assert torch.equal(h, h_plain) and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_with_delta_norm_matches_gemma2_layer(dtype):
    """Gemma 2's decoder layer between attention and MLP: the post-attention norm of the
    attention's output, the residual add, the pre-feedforward norm (HF's modules, in order)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    g = rng(11)
    N = 96
    h = randn(g, 3, N, dtype=dtype, device="cpu", scale=3.0)
    attn_out = randn(g, 3, N, dtype=dtype, device="cpu")
    post, pre = Gemma2RMSNorm(N, eps=1e-6).to(dtype), Gemma2RMSNorm(N, eps=1e-6).to(dtype)
    with torch.no_grad():
        post.weight.copy_(randn(g, N, dtype=dtype, device="cpu", scale=0.3))
        pre.weight.copy_(randn(g, N, dtype=dtype, device="cpu", scale=0.3))
        residual = h + post(attn_out)
        want = pre(residual)
    got = add_rmsnorm_forward_torch(h, attn_out, 1.0 + pre.weight.detach().float(), 1e-6, round_first=False,
                                    delta_weight=1.0 + post.weight.detach().float())
    torch.testing.assert_close(h, residual, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("round_first", [True, False], ids=["llama", "gemma"])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,N", [SHAPES[1], SHAPES[3]])
def test_triton_with_delta_norm_matches_twin(device, dtype, n, N, round_first):
    g = rng(N + 3)
    h = randn(g, n, N, dtype=dtype, device=device, scale=3.0)
    delta = randn(g, n, N, dtype=dtype, device=device, scale=5.0)
    w, dw = randn(g, N, dtype=dtype, device=device), randn(g, N, dtype=dtype, device=device)
    if not round_first:
        w, dw = 1.0 + w.float(), 1.0 + dw.float()
    h_twin = h.clone()
    want = add_rmsnorm_forward_torch(h_twin, delta, w, 1e-6, round_first, delta_weight=dw)
    got = add_rmsnorm_forward_triton(h, delta, w, 1e-6, round_first, delta_weight=dw)
    torch.testing.assert_close(h, h_twin, **tol(dtype))
    torch.testing.assert_close(got, want, **tol(dtype))
