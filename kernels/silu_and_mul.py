"""SwiGLU activation of a fused gate_up projection: silu(x[:, :I]) * x[:, I:].

Rounded as HF's ``act_fn(gate_proj(x)) * up_proj(x)``: silu's output rounds to x's dtype before
the multiply, then the product rounds again. In fp32 that is plain fp32 math; in bf16 a single
rounding at the end would differ from HF's by a unit in the last place on a good share of values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import as_rows, launcher, next_pow2, pdl, use_triton
from .triton_math import pdl_wait, silu


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = silu(gate).to(X.dtype.element_ty).to(tl.float32)  # HF's act_fn output
    tl.store(Y + row * stride_y + cols, (act * up).to(Y.dtype.element_ty), mask=mask)


def launch_act_and_mul(kernel: Any, x: torch.Tensor) -> torch.Tensor:
    """Run a gated activation ``kernel(X, Y, stride_x, stride_y, I, BLOCK=..., PDL=...)`` over x ``[n, 2*I]``
    (``[gate | up]``), a program per row and block of columns; returns the new ``[n, I]`` output."""
    I = x.shape[-1] // 2
    x2 = as_rows(x)
    y = torch.empty((x2.shape[0], I), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        BLOCK = min(next_pow2(I), 1024)
        launcher(kernel, x2)[(x2.shape[0], triton.cdiv(I, BLOCK))](
            x2, y, x2.stride(0), y.stride(0), I, BLOCK=BLOCK, num_warps=4, **pdl(x2),
        )
    return y.view(*x.shape[:-1], I)


def silu_and_mul_fwd_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of `silu_and_mul_fwd`."""
    return launch_act_and_mul(_silu_and_mul_kernel, x)


def silu_and_mul_fwd_torch(x: torch.Tensor) -> torch.Tensor:
    """Torch twin of `silu_and_mul_fwd`."""
    # In x's dtype, op for op as HF's LlamaMLP: F.silu computes in fp32 and rounds, so does the *.
    I = x.shape[-1] // 2
    return F.silu(x[..., :I]) * x[..., I:]


def silu_and_mul_fwd(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [n, 2*I] = [gate | up]; returns a new [n, I] tensor in x's dtype."""
    if use_triton(x):
        return silu_and_mul_fwd_triton(x)
    return silu_and_mul_fwd_torch(x)
