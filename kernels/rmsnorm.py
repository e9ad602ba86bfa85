"""RMSNorm matching HF LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), or with
``round_first=False`` HF GemmaRMSNorm's order: (x * rsqrt(...) * weight) in fp32, rounded once (a
Gemma weight is stored as the fp32 ``1 + w`` it multiplies by)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launch_row_norm, use_triton
from .triton_math import pdl_wait


@triton.jit
def row_rstd(x_row, N, eps, BLOCK_N: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of the N values at x_row, read in BLOCK_N chunks."""
    sq = tl.zeros([BLOCK_N], tl.float32)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        sq += x * x
    return tl.math.rsqrt(tl.sum(sq, 0) / N + eps)


@triton.jit
def store_row_norm(h_row, W, y_row, N, rstd, BLOCK_N: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """The row at ``h_row`` (its 1 / rms ``rstd``), normalised and weighted into ``y_row``: the
    norm's last pass (after an add-norm's first, behind a barrier: other threads wrote the row)."""
    dtype = h_row.dtype.element_ty
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = cols < N
        s = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        x = s * rstd
        if ROUND_FIRST:  # Llama: HF rounds the normalised value to the dtype before the weight multiply
            x = x.to(dtype).to(tl.float32)
        tl.store(y_row + cols, (w * x).to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
                    ROUND_FIRST: tl.constexpr):
    # One program per row; rows wider than BLOCK_N are walked in chunks.
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    store_row_norm(x_row, W, y_row, N, row_rstd(x_row, N, eps, BLOCK_N), BLOCK_N, ROUND_FIRST)


def rmsnorm_forward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True) -> torch.Tensor:
    """Triton version of `rmsnorm_forward`."""
    return launch_row_norm(_rmsnorm_kernel, x, (weight,), eps, ROUND_FIRST=round_first)


def rmsnorm_forward_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True) -> torch.Tensor:
    """Torch twin of `rmsnorm_forward`, written as HF LlamaRMSNorm (or GemmaRMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if not round_first:
        return (h * weight.float()).to(x.dtype)
    return (weight * h.to(x.dtype)).to(x.dtype)


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True) -> torch.Tensor:
    """RMSNorm of x [n, N] (any leading dims) with weight [N]; returns a new tensor in x's dtype.
    round_first: round the normalised value to x's dtype before the weight multiply (Llama), or
    multiply in fp32 and round once (Gemma)."""
    if use_triton(x):
        return rmsnorm_forward_triton(x, weight, eps, round_first)
    return rmsnorm_forward_torch(x, weight, eps, round_first)
