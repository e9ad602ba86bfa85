"""silu_and_mul_fwd: twin vs F.silu in fp64, Triton vs twin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICE_DTYPES, randn, rng, tol

from llmserve.kernels.silu_and_mul import silu_and_mul_fwd_torch, silu_and_mul_fwd_triton

SHAPES = [(1, 64), (7, 100), (3, 1500)]  # (n, I); 1500 spans two 1024-wide blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,I", SHAPES)
def test_twin_matches_silu(n, I, dtype):
    x = randn(rng(I), n, 2 * I, dtype=dtype, device="cpu", scale=4.0)
    want = F.silu(x[:, :I].double()) * x[:, I:].double()
    got = silu_and_mul_fwd_torch(x)
    assert got.dtype == dtype and got.shape == (n, I)
    torch.testing.assert_close(got.double(), want, **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,I", SHAPES)
def test_triton_matches_twin(device, dtype, n, I):
    x = randn(rng(I + 1), n, 2 * I, dtype=dtype, device=device, scale=4.0)
    want = silu_and_mul_fwd_torch(x)
    got = silu_and_mul_fwd_triton(x)
    assert got.dtype == dtype and got.shape == (n, I)
    torch.testing.assert_close(got, want, **tol(dtype))
