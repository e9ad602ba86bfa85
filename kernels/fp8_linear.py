"""Linear layer on an FP8 weight with per-channel scales (W8A8): activations are quantized to
float8_e4m3 per token (dynamic, a scale per row: amax / 448) or by a static per-tensor scale from
the checkpoint, then multiplied on the FP8 tensor cores by ``torch._scaled_mm`` with row-wise
scales (Hopper, sm_89+): y = (xq @ wq^T) * x_scale[m] * w_scale[n]. The activations are quantized by
one Triton kernel a linear (`_quantize_fp8_rows_kernel`: a row's absmax, its scale, the e4m3
values and the scale written in one pass over the row, bit for bit the twin's), where the torch
ops took seven launches and as long as the FP8 GEMM itself at batch 128; its outputs are the
contiguous tensors `_scaled_mm` takes, so nothing is copied around the GEMM.

One row goes to `dequant_linear`'s GEMV instead (the weight dequantized in registers, the
activations kept in their dtype): a batch-1 step is the weight's read, and a GEMV reads it faster
than a GEMM padded to 16 rows; it is also slightly more accurate, as the row is not rounded.
Shapes `_scaled_mm` refuses (K or N not a multiple of 16) take that dequantizing kernel too.

The torch twin computes the W8A8 product exactly as defined above in float32.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from . import autotune
from .backend import launcher, next_pow2, pdl, use_triton
from .dequant_linear import dequant_linear_triton
from .triton_math import pdl_wait

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_MIN_SCALE = 1e-12 / FP8_MAX    # an all-zero row gets a tiny scale, not a division by zero
# Up to this many rows the weight is dequantized in the kernel (W8A16: `dequant_linear`'s GEMV or
# GEMM) rather than the activations quantized for `_scaled_mm`; `benchmarks/quantized_gemv.py`'s
# "fp8 w8a16" column says where that wins.
W8A16_MAX_ROWS = 1
# What runs the W8A8 product above that: "scaled_mm" (cuBLAS's FP8 GEMM) or "triton"
# (`_fp8_gemm_kernel`, autotuned); quantized_gemv.py's "fp8 triton" column times the second.
W8A8_GEMM = "scaled_mm"


@triton.jit
def _round_to_e4m3(v):
    """float32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32.

    Its cast to float8 is then exact. The GPU's cast rounds so itself; Triton 3.7's interpreter
    does not (it rounds ties away and does not carry a rounded-up mantissa into the exponent: 127.7
    becomes 64), and the kernel must be tested there. Adding then subtracting C = 2^23 quanta
    rounds |v| to a whole number of quanta; the quantum is 2^-3 of v's power of two, 2^-9 below
    e4m3's smallest normal 2^-6."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    c = ((exponent - 3 + 23) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(v) + c) - c
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_fp8_rows_kernel(X, XQ, XS, InputScale, K, stride_x_m, stride_q_m,
                              STATIC: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                              BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_x_m
    q_row = XQ + row.to(tl.int64) * stride_q_m
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(InputScale).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        # Rounded division, as the twin's: the scale and so every value match it bit for bit.
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), FP8_MAX), MIN_SCALE)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX))
        tl.store(q_row + k0 + offs, q.to(XQ.dtype.element_ty), mask=k0 + offs < K)
    tl.store(XS + row, scale)


def quantize_fp8_rows_torch(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of `quantize_fp8_rows`."""
    xf = x.float()
    if input_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_fp8_rows_triton(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `quantize_fp8_rows`: one program a row."""
    M, K = x.shape
    xq = torch.empty(M, K, dtype=FP8, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        block = min(2048, max(16, next_pow2(K)))
        launcher(_quantize_fp8_rows_kernel, x)[(M,)](
            x, xq, scale, input_scale if input_scale is not None else scale, K, x.stride(0), xq.stride(0),
            STATIC=input_scale is not None, FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, BLOCK=block,
            num_warps=4 if block <= 1024 else 8,
            **pdl(x),
        )
    return xq, scale


def quantize_fp8_rows(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` (unit-stride rows) as float8 values and float32 scales ``[M, 1]``: per row
    (``input_scale`` None: amax / 448) or by the static per-tensor ``input_scale``."""
    if use_triton(x) and x.stride(-1) == 1:
        return quantize_fp8_rows_triton(x, input_scale)
    return quantize_fp8_rows_torch(x, input_scale)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None) -> torch.Tensor:
    """Torch twin: the W8A8 product in float32."""
    rows = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8_rows_torch(rows, input_scale)
    y = (xq.float() @ weight.float().t()) * xs * weight_scale.float()[None, :]
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


@triton.jit
def _fp8_gemm_kernel(XQ, XS, W, WS, Y, M, N, K, ROWS, stride_x_m, stride_w_n, stride_y_m,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     PDL: tl.constexpr):
    """y = (xq @ w^T) * xs[m] * ws[n] on FP8 tensor cores, the weight tile the dot's first operand
    (y^T = W xq^T: a few rows still fill the MMA's 64-row side). ROWS: the autotuner's key."""
    pdl_wait(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_w_n + offs_k[None, :]
    x_ptrs = XQ + offs_m[None, :].to(tl.int64) * stride_x_m + offs_k[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[None, :] & (k0 + offs_k < K)[:, None], other=0.0)
        acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    ws = tl.load(WS + offs_n, mask=n_mask, other=0.0)
    xs = tl.load(XS + offs_m, mask=m_mask, other=0.0)
    y_ptrs = Y + offs_m[None, :].to(tl.int64) * stride_y_m + offs_n[:, None]
    tl.store(y_ptrs, (acc * ws[:, None] * xs[None, :]).to(Y.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


# By row bucket (`autotune.rows_bucket`; 128 stands for 128 and more): (BLOCK_M, BLOCK_N, BLOCK_K,
# num_warps, num_stages).
FP8_GEMM_TILES = {
    16: [(16, 64, 128, 4, 5), (16, 64, 256, 4, 4), (16, 128, 128, 4, 4), (16, 32, 256, 4, 4)],
    32: [(32, 64, 128, 4, 5), (32, 64, 256, 4, 4), (32, 128, 128, 4, 4)],
    64: [(64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (64, 128, 256, 8, 3)],
    128: [(64, 128, 128, 4, 4), (128, 128, 128, 8, 3), (128, 64, 256, 4, 3), (128, 128, 256, 8, 3)],
}
_FP8_BY_ROWS = {rows: [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                       for m, n, k, w, st in tiles] for rows, tiles in FP8_GEMM_TILES.items()}


def _prune_fp8_gemm(configs, nargs, **_):
    fits = _FP8_BY_ROWS[min(nargs["ROWS"], max(FP8_GEMM_TILES))]
    return [triton.Config({**c.kwargs, "EVEN_K": nargs["K"] % c.kwargs["BLOCK_K"] == 0},
                          num_warps=c.num_warps, num_stages=c.num_stages) for c in fits]


_fp8_gemm = autotune.autotune([c for cs in _FP8_BY_ROWS.values() for c in cs], key=["N", "K", "ROWS"],
                              prune=_prune_fp8_gemm)(_fp8_gemm_kernel)


def fp8_gemm_triton(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    out_dtype: torch.dtype, *, config: triton.Config | None = None) -> torch.Tensor:
    """(xq @ weight^T) * xs * weight_scale in ``out_dtype``: xq float8 ``[M, K]``, xs float32
    ``[M, 1]``; ``config`` forces a tile instead of the autotuner's choice."""
    (M, K), N = xq.shape, weight.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M:
        args = {"XQ": xq, "XS": xs, "W": weight, "WS": weight_scale, "Y": y, "M": M, "N": N, "K": K,
                "ROWS": autotune.rows_bucket(M), "stride_x_m": xq.stride(0), "stride_w_n": weight.stride(0),
                "stride_y_m": y.stride(0)}
        autotune.launch(_fp8_gemm, xq, lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, meta["BLOCK_M"])),
                        args, {}, config)
    return y


def takes_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `_scaled_mm` (or, with W8A8_GEMM "triton", `_fp8_gemm_kernel`) runs this product:
    CUDA of compute capability 8.9 or more, dims that are multiples of 16, more than
    `W8A16_MAX_ROWS` rows."""
    n, k = weight.shape
    return (x.is_cuda and x.numel() > W8A16_MAX_ROWS * k and n % 16 == 0 and k % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_linear_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None, gemm: str | None = None) -> torch.Tensor:
    """The W8A8 product on the GPU: activations quantized by one kernel, then ``gemm`` (default
    `W8A8_GEMM`)."""
    rows = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8_rows_triton(rows if rows.stride(-1) == 1 else rows.contiguous(), input_scale)
    if (gemm or W8A8_GEMM) == "triton":
        y = fp8_gemm_triton(xq, xs, weight, weight_scale, x.dtype)
    else:
        # Row-wise scaling wants bf16 out; weight^T is column-major as the FP8 GEMM needs. xq, xs
        # and the float32 weight_scale (Fp8Weight keeps it so) are what it takes: no copies.
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1),
                             out_dtype=torch.bfloat16).to(x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ (weight * weight_scale[:, None])^T with x quantized to FP8 (see the module doc);
    ``weight`` float8 ``[N, K]``, ``weight_scale`` float32 ``[N]``."""
    if not use_triton(x):
        return fp8_linear_torch(x, weight, weight_scale, input_scale)
    if takes_scaled_mm(x, weight):
        return fp8_linear_w8a8(x, weight, weight_scale, input_scale)
    return dequant_linear_triton(x, weight, weight_scale.view(-1, 1), None, (1, weight.shape[1]))
