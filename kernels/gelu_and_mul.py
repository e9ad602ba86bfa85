"""GeGLU activation of a fused gate_up projection: gelu_tanh(x[:, :I]) * x[:, I:] (Gemma's MLP).

gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (`triton_math.gelu_tanh`). Rounded as HF's
``act_fn(gate_proj(x)) * up_proj(x)``: the activation rounds to x's dtype before the multiply, as
in `silu_and_mul`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import use_triton
from .silu_and_mul import launch_act_and_mul
from .triton_math import gelu_tanh, pdl_wait

@triton.jit
def _gelu_and_mul_kernel(X, Y, stride_x, stride_y, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = gelu_tanh(gate).to(X.dtype.element_ty).to(tl.float32)        # HF's act_fn output
    tl.store(Y + row * stride_y + cols, (act * up).to(Y.dtype.element_ty), mask=mask)


def gelu_and_mul_fwd_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of `gelu_and_mul_fwd`."""
    return launch_act_and_mul(_gelu_and_mul_kernel, x)


def gelu_and_mul_fwd_torch(x: torch.Tensor) -> torch.Tensor:
    """Torch twin of `gelu_and_mul_fwd`, op for op as HF's GemmaMLP (``gelu_pytorch_tanh``)."""
    I = x.shape[-1] // 2
    return F.gelu(x[..., :I], approximate="tanh") * x[..., I:]


def gelu_and_mul_fwd(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for x [n, 2*I] = [gate | up]; returns a new [n, I] tensor in x's dtype."""
    if use_triton(x):
        return gelu_and_mul_fwd_triton(x)
    return gelu_and_mul_fwd_torch(x)
