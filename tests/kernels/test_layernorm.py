"""layernorm_forward: twin vs F.layer_norm in fp64, Triton vs twin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICE_DTYPES, randn, rng, tol

from llmserve.kernels.layernorm import layernorm_forward_torch, layernorm_forward_triton

SHAPES = [(1, 64), (5, 100), (2, 5000)]  # 5000 > one 4096 block: chunked rows


def inputs(seed: int, n: int, N: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = rng(seed)
    # An offset mean checks the variance is taken around the mean, not as E[x^2] - mean^2.
    x = randn(g, n, N, dtype=torch.float32, device=device, scale=2.0) + 5.0
    return (x.to(dtype), randn(g, N, dtype=dtype, device=device), randn(g, N, dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,N", SHAPES)
def test_twin_matches_layer_norm(n, N, dtype):
    x, w, b = inputs(N, n, N, dtype, "cpu")
    want = F.layer_norm(x.double(), (N,), w.double(), b.double(), 1e-5)
    got = layernorm_forward_torch(x, w, b, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,N", SHAPES)
def test_triton_matches_twin(device, dtype, n, N):
    x, w, b = inputs(N + 1, n, N, dtype, device)
    want = layernorm_forward_torch(x, w, b, 1e-5)
    got = layernorm_forward_triton(x, w, b, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **tol(dtype))
