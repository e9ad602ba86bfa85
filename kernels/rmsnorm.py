"""RMSNorm matching HF LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launch_row_norm, use_triton


@triton.jit
def _rmsnorm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    # One program per row; rows wider than BLOCK_N are walked in chunks.
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    sq = tl.zeros([BLOCK_N], tl.float32)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        sq += x * x
    rstd = tl.math.rsqrt(tl.sum(sq, 0) / N + eps)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        # HF rounds the normalised value to x's dtype before the weight multiply.
        h = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
        tl.store(y_row + cols, (w * h).to(Y.dtype.element_ty), mask=mask)


def rmsnorm_forward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `rmsnorm_forward`."""
    return launch_row_norm(_rmsnorm_kernel, x, (weight,), eps)


def rmsnorm_forward_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch twin of `rmsnorm_forward`, written as HF LlamaRMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(x.dtype)


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [n, N] (any leading dims) with weight [N]; returns a new tensor in x's dtype."""
    if use_triton(x):
        return rmsnorm_forward_triton(x, weight, eps)
    return rmsnorm_forward_torch(x, weight, eps)
