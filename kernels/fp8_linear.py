"""Linear layer on an FP8 weight with per-channel scales (W8A8): activations are quantized to
float8_e4m3 per token (dynamic, a scale per row: amax / 448) or by a static per-tensor scale from
the checkpoint, then multiplied on the FP8 tensor cores by ``torch._scaled_mm`` with row-wise
scales (Hopper, sm_89+): y = (xq @ wq^T) * x_scale[m] * w_scale[n].

One row goes to `dequant_linear`'s GEMV instead (the weight dequantized in registers, the
activations kept in their dtype): a batch-1 step is the weight's read, and a GEMV reads it faster
than a GEMM padded to 16 rows; it is also slightly more accurate, as the row is not rounded.
Shapes `_scaled_mm` refuses (K or N not a multiple of 16) take that dequantizing kernel too.

The torch twin computes the W8A8 product exactly as defined above in float32.
"""

from __future__ import annotations

import torch

from .backend import use_triton
from .dequant_linear import dequant_linear_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_MIN_SCALE = 1e-12 / FP8_MAX    # an all-zero row gets a tiny scale, not a division by zero


def quantize_fp8_rows(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` as float8 values and float32 scales ``[M, 1]``: per row (``input_scale`` None)
    or by the static per-tensor ``input_scale``."""
    xf = x.float()
    if input_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None) -> torch.Tensor:
    """Torch twin: the W8A8 product in float32."""
    rows = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8_rows(rows, input_scale)
    y = (xq.float() @ weight.float().t()) * xs * weight_scale.float()[None, :]
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def takes_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `_scaled_mm` runs this product: CUDA of compute capability 8.9 or more, dims that
    are multiples of 16, more than one row."""
    n, k = weight.shape
    return (x.is_cuda and x.numel() > k and n % 16 == 0 and k % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8_rows(rows, input_scale)
    # Row-wise scaling wants bf16 out; weight^T is column-major as the FP8 GEMM needs.
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs.contiguous(), scale_b=weight_scale.float().view(1, -1),
                         out_dtype=torch.bfloat16)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ (weight * weight_scale[:, None])^T with x quantized to FP8 (see the module doc);
    ``weight`` float8 ``[N, K]``, ``weight_scale`` float32 ``[N]``."""
    if not use_triton(x):
        return fp8_linear_torch(x, weight, weight_scale, input_scale)
    if takes_scaled_mm(x, weight):
        return fp8_linear_scaled_mm(x, weight, weight_scale, input_scale)
    return dequant_linear_triton(x, weight, weight_scale.view(-1, 1), None, (1, weight.shape[1]))
