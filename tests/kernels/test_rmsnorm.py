"""rmsnorm_forward: twin vs HF LlamaRMSNorm, Triton vs twin."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, DEVICES, randn, rng, tol
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from llmserve.kernels.rmsnorm import rmsnorm_forward_torch, rmsnorm_forward_triton

SHAPES = [(1, 64), (5, 100), (3, 4096), (2, 5000)]  # 5000 > one 4096 block: chunked rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,N", SHAPES)
def test_twin_matches_hf(n, N, dtype):
    g = rng(N)
    x = randn(g, n, N, dtype=dtype, device="cpu", scale=3.0)
    norm = LlamaRMSNorm(N, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(g, N, dtype=dtype, device="cpu"))
        want = norm(x)
    got = rmsnorm_forward_torch(x, norm.weight.detach(), 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # same ops in the same order


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,N", SHAPES)
def test_triton_matches_twin(device, dtype, n, N):
    g = rng(N + 1)
    x = randn(g, n, N, dtype=dtype, device=device, scale=3.0)
    w = randn(g, N, dtype=dtype, device=device)
    want = rmsnorm_forward_torch(x, w, 1e-6)
    got = rmsnorm_forward_triton(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_triton_leading_dims_and_strided_rows(device):
    g = rng(7)
    x = randn(g, 2, 3, 2 * 96, dtype=torch.float32, device=device)[..., :96]  # rows with a gap
    w = randn(g, 96, dtype=torch.float32, device=device)
    torch.testing.assert_close(rmsnorm_forward_triton(x, w, 1e-6), rmsnorm_forward_torch(x, w, 1e-6),
                               **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,N", SHAPES)
def test_gemma_twin_matches_hf(n, N, dtype):
    """Gemma's order: fp32 norm times the fp32 (1 + w), rounded once; the weight passed is 1 + w."""
    g = rng(N + 2)
    x = randn(g, n, N, dtype=dtype, device="cpu", scale=3.0)
    norm = Gemma2RMSNorm(N, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(g, N, dtype=dtype, device="cpu", scale=0.3))
        want = norm(x)
    got = rmsnorm_forward_torch(x, 1.0 + norm.weight.detach().float(), 1e-6, round_first=False)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,N", SHAPES[:2])
def test_gemma_triton_matches_twin(device, dtype, n, N):
    g = rng(N + 3)
    x = randn(g, n, N, dtype=dtype, device=device, scale=3.0)
    w = 1.0 + randn(g, N, dtype=torch.float32, device=device, scale=0.3)
    want = rmsnorm_forward_torch(x, w, 1e-6, round_first=False)
    got = rmsnorm_forward_triton(x, w, 1e-6, round_first=False)
    torch.testing.assert_close(got, want, **tol(dtype))
