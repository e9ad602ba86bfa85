"""Linear layer of a few rows, y = x @ W^T (+ bias), for decode steps of 2 to 64 requests.

A decode step's linear layers multiply a handful of rows by weights of millions of elements: the
time is the weight's read from memory, as at one row (`gemv.py`), but with enough rows for tensor
cores to be worth it. cuBLAS reads those weights at 2.0-2.8 TB/s on an H100, with its slowest
case the LM head (128k x 4096: 422 µs at 32 rows, 2.49 TB/s). This kernel keeps a whole
[BLOCK_M >= M, BLOCK_N] output tile per program, with its K loop software-pipelined 3-5 stages
deep, and reads them at up to 3.0 TB/s (the LM head in 356 µs); `tiles_for` says where it wins
on an H100, and `beats_cublas` checks each shape on the card it runs on.
Split-K never paid in the sweep (benchmarks/README.md, `python benchmarks/decode_linear.py`), so
each output feature's sum runs over K in one program, in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import autotune
from .backend import half_precision_on_triton, launcher, next_pow2, pdl, use_triton
from .triton_math import pdl_wait

# Tiles (BLOCK_N, BLOCK_K, num_warps, num_stages) and where they beat cuBLAS, from the H100 sweep
# (`benchmarks/decode_linear.py --sweep`, Llama-3-8B's weights): up to 16 rows, on every weight
# but the qkv projection (within 5%) by 2-20%; from 17 to 64 rows, cuBLAS's tensor-core kernels
# caught up except on the LM head, whose 128k-wide weight cuBLAS still reads at ~2.4 TB/s.
FEW_ROWS, FEW_ROWS_TILES = 16, (32, 256, 4, 5)
MAX_ROWS, WIDE_N, WIDE_TILES = 64, 65536, (128, 128, 8, 3)


def tiles_for(rows: int, n: int) -> tuple[int, int, int, int] | None:
    """The tiles for a product of `rows` rows by an [n, K] weight, or None where cuBLAS is faster."""
    if 2 <= rows <= FEW_ROWS:
        return FEW_ROWS_TILES
    if rows <= MAX_ROWS and n >= WIDE_N:
        return WIDE_TILES
    return None


@triton.jit
def _skinny_gemm_kernel(
    X, W, Bias, Y, M, N, K, stride_x_m, stride_w_n, stride_y_m,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = X + offs_m[:, None] * stride_x_m + offs_k[None, :]
    # int64: row * stride can pass 2**31 in a large LM head (256k rows x 8192 columns).
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_w_n + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None] * stride_y_m + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       *, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Triton version of `skinny_gemm`; `tiles` (BLOCK_N, BLOCK_K, num_warps, num_stages)
    overrides `tiles_for`'s choice (the benchmark's sweep)."""
    N, K = weight.shape
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    assert M <= MAX_ROWS and rows.stride(1) == 1 and weight.stride(1) == 1
    tiles = tiles or tiles_for(M, N)
    assert tiles is not None, f"no tiles for {M} rows x {N} columns: cuBLAS's (see tiles_for)"
    block_n, block_k, num_warps, num_stages = tiles
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = max(16, next_pow2(M))
    block_k = min(block_k, max(16, next_pow2(K)))
    launcher(_skinny_gemm_kernel, x)[(triton.cdiv(N, block_n),)](
        rows, weight, bias if bias is not None else weight, y, M, N, K,
        rows.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=K % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
        **pdl(x),
    )
    return y.view(*x.shape[:-1], N)


def skinny_gemm_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of `skinny_gemm`: the linear layer itself."""
    return F.linear(x, weight, bias)


def takes_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` should run x @ weight^T here: as many rows as `tiles_for` has tiles for,
    that our half-precision kernels may take (`half_precision_on_triton`), where this card runs
    it faster than cuBLAS (`beats_cublas`)."""
    rows = x.numel() // x.shape[-1]
    return (tiles_for(rows, weight.shape[0]) is not None and half_precision_on_triton(x, weight)
            and beats_cublas(x, weight, rows))


# Whether skinny_gemm beats cuBLAS depends on the card, not only the shape: `tiles_for` is the
# H100's sweep, while on an H200 cuBLAS read Llama-3-8B's weights at 5 and 9 rows in 4.01 and 4.06
# ms a step against this kernel's 4.30 and 4.31 (`benchmarks/decode_linear.py --rows 1,5,9`,
# 2026-11-27). So the first call of each (card, weight shape, dtype, power-of-two row bucket)
# times both (`autotune.faster`) and keeps the faster.
def beats_cublas(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    """Whether `skinny_gemm` runs a product of ``rows`` rows of x by ``weight`` faster than cuBLAS
    on this GPU (measured once per shape and row bucket); in Triton's interpreter, yes."""
    if not x.is_cuda:
        return True
    key = ("skinny_gemm", x.device, tuple(weight.shape), weight.dtype, next_pow2(rows))
    return autotune.faster(key, lambda: skinny_gemm_triton(x, weight), lambda: F.linear(x, weight))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T + bias for x ``[..., K]`` of at most 64 rows, weight ``[N, K]``."""
    if use_triton(x):
        return skinny_gemm_triton(x, weight, bias)
    return skinny_gemm_torch(x, weight, bias)
