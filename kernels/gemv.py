"""One-row linear layer, y = x @ W^T (+ bias), for batch-1 decode steps.

With one input row a linear layer is a stream over its weight: every element is read once and
used once. At that shape cuBLAS runs a split-K GEMV plus a reduce kernel that reads 2.0-2.85 TB/s
on an H100 (the smaller the matrix, the lower), while this kernel reads 2.6-3.15 TB/s. A batch-1
Llama-3-8B step reads its 15 GB of weights ~0.55 ms sooner: 5.08 instead of 5.63 ms of GEMVs
(`benchmarks/decode_linear.py`; table in benchmarks/README.md). From two rows on, tensor cores
pay: `skinny_gemm` takes 2 to 64 rows.

Program p owns BLOCK_N output features and walks the whole of K in BLOCK_K-wide chunks: each
iteration loads a [BLOCK_N, BLOCK_K] weight tile (16 KB in flight a program) and adds its products
into an fp32 tile of the same shape, reduced over K once at the end. Summing each chunk as it
arrives would put a cross-lane reduction in the loop; a single pass over K needs no second kernel
and makes every output feature's sum order independent of the grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import half_precision_on_triton, launcher, next_pow2, use_triton

# (BLOCK_N, largest BLOCK_K, num_warps), from the H100 sweep (`benchmarks/decode_linear.py --sweep`,
# Llama-3-8B's five weights in bf16): the best of 16 choices on four of them, within 1% on gate_up.
TILES = (4, 2048, 4)


@triton.jit
def _gemv_kernel(
    X, W, Bias, Y, N, K, stride_w_n,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # int64: row * stride can pass 2**31 in a large LM head (256k rows x 8192 columns).
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_w_n + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            x = tl.load(X + k0 + offs_k)
        else:
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(X + k0 + offs_k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_mask)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                *, tiles: tuple[int, int, int] = TILES) -> torch.Tensor:
    """Triton version of `gemv`; `tiles` (BLOCK_N, largest BLOCK_K, num_warps) for the benchmark's sweep."""
    N, K = weight.shape
    assert x.numel() == K and x.is_contiguous() and weight.stride(1) == 1, "gemv takes one contiguous row"
    block_n, max_block_k, num_warps = tiles
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    block_k = min(max_block_k, max(16, next_pow2(K)))
    launcher(_gemv_kernel, x)[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=K % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=1,
    )
    return y


def gemv_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of `gemv`: the linear layer itself."""
    return F.linear(x, weight, bias)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` should run x @ weight^T here: one contiguous row that our half-precision
    kernels may take (`half_precision_on_triton`); two rows or more are `skinny_gemm`'s or cuBLAS's."""
    return x.numel() == x.shape[-1] and x.is_contiguous() and half_precision_on_triton(x, weight)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T + bias for x of one row ``[..., K]`` (leading dims of size 1), weight ``[N, K]``."""
    if use_triton(x):
        return gemv_triton(x, weight, bias)
    return gemv_torch(x, weight, bias)
