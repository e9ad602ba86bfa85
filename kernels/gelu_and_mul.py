"""GeGLU activation of a fused gate_up projection: gelu_tanh(x[:, :I]) * x[:, I:] (Gemma's MLP).

gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), computed as g * sigmoid(2u)
(the same value, without the cancellation of 1 + tanh(u) for very negative u). Rounded as HF's
``act_fn(gate_proj(x)) * up_proj(x)``: the activation rounds to x's dtype before the multiply, as
in `silu_and_mul`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import as_rows, launcher, next_pow2, use_triton

SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def _gelu_and_mul_kernel(X, Y, stride_x, stride_y, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    u = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    act = gate / (1.0 + tl.exp(-2.0 * u))                              # 0.5 g (1 + tanh(u))
    act = act.to(X.dtype.element_ty).to(tl.float32)                    # HF's act_fn output
    tl.store(Y + row * stride_y + cols, (act * up).to(Y.dtype.element_ty), mask=mask)


def gelu_and_mul_fwd_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of `gelu_and_mul_fwd`."""
    I = x.shape[-1] // 2
    x2 = as_rows(x)
    y = torch.empty((x2.shape[0], I), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        BLOCK = min(next_pow2(I), 1024)
        launcher(_gelu_and_mul_kernel, x2)[(x2.shape[0], triton.cdiv(I, BLOCK))](
            x2, y, x2.stride(0), y.stride(0), I, BLOCK=BLOCK, num_warps=4,
        )
    return y.view(*x.shape[:-1], I)


def gelu_and_mul_fwd_torch(x: torch.Tensor) -> torch.Tensor:
    """Torch twin of `gelu_and_mul_fwd`, op for op as HF's GemmaMLP (``gelu_pytorch_tanh``)."""
    I = x.shape[-1] // 2
    return F.gelu(x[..., :I], approximate="tanh") * x[..., I:]


def gelu_and_mul_fwd(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for x [n, 2*I] = [gate | up]; returns a new [n, I] tensor in x's dtype."""
    if use_triton(x):
        return gelu_and_mul_fwd_triton(x)
    return gelu_and_mul_fwd_torch(x)
