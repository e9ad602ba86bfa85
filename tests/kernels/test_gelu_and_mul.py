"""gelu_and_mul_fwd: twin vs the tanh-GELU formula in fp64, Triton vs twin."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, randn, rng, tol

from llmserve.kernels.gelu_and_mul import gelu_and_mul_fwd_torch, gelu_and_mul_fwd_triton

SHAPES = [(1, 64), (7, 100), (3, 1500)]  # (n, I); 1500 spans two 1024-wide blocks


def gelu_tanh(g: torch.Tensor) -> torch.Tensor:
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,I", SHAPES)
def test_twin_matches_formula(n, I, dtype):
    x = randn(rng(I), n, 2 * I, dtype=dtype, device="cpu", scale=4.0)
    want = gelu_tanh(x[:, :I].double()) * x[:, I:].double()
    got = gelu_and_mul_fwd_torch(x)
    assert got.dtype == dtype and got.shape == (n, I)
    torch.testing.assert_close(got.double(), want, **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,I", SHAPES)
def test_triton_matches_twin(device, dtype, n, I):
    x = randn(rng(I + 1), n, 2 * I, dtype=dtype, device=device, scale=4.0)
    want = gelu_and_mul_fwd_torch(x)
    got = gelu_and_mul_fwd_triton(x)
    assert got.dtype == dtype and got.shape == (n, I)
    torch.testing.assert_close(got, want, **tol(dtype))
