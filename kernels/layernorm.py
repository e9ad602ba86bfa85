"""LayerNorm with affine weight and bias, computed in fp32 and cast to x's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import launch_row_norm, use_triton
from .triton_math import pdl_wait


@triton.jit
def _layernorm_kernel(X, W, B, Y, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    # One program per row; mean first, then the variance around it (stabler than E[x^2] - mean^2).
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    acc = tl.zeros([BLOCK_N], tl.float32)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        acc += tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
    mean = tl.sum(acc, 0) / N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - mean, 0.0)
        acc += xc * xc
    rstd = tl.math.rsqrt(tl.sum(acc, 0) / N + eps)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, ((x - mean) * rstd * w + b).to(Y.dtype.element_ty), mask=mask)


def layernorm_forward_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `layernorm_forward`."""
    return launch_row_norm(_layernorm_kernel, x, (weight, bias), eps)


def layernorm_forward_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch twin of `layernorm_forward`."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def layernorm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm of x [n, N] (any leading dims) with weight, bias [N]; returns a new tensor in x's dtype."""
    if use_triton(x):
        return layernorm_forward_triton(x, weight, bias, eps)
    return layernorm_forward_torch(x, weight, bias, eps)
