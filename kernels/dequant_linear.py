"""Linear layer on a weight stored in 8 or 4 bits with scales per block: the weight is dequantized
tile by tile inside the GEMM, never whole in memory, and multiplied in the activations' dtype.

It serves the formats whose bytes, not their arithmetic, make them fast: block-wise FP8
(DeepSeek / Qwen3-FP8: float8 values, a scale per 128 x 128 tile), 4-bit AWQ / GPTQ (a scale and a
zero point per group of 128 columns of a row) and the one-row step of per-channel FP8 (a GEMV, where
quantizing the activations would buy nothing: the step is the weight's read).

Storage (``llmserve.quantization.weights``): ``W`` float8 ``[N, K]``, or uint8 ``[N, K / 2]`` with
column 2j in byte j's low nibble and 2j + 1 in its high one; ``S`` the scales ``[ceil(N / BN),
ceil(K / BK)]``, one per ``(BN, BK)`` block; ``Z`` (4-bit only) integer zero points ``[N, K / BK]``.
Value = (q - z) * s.

A program owns a ``[BLOCK_M, BLOCK_N]`` output tile and walks K in ``BLOCK_K`` steps no wider than a
scale block, so each weight tile needs one scale (and zero) per row: one load of ``BLOCK_N`` values.
One row (``BLOCK_M == 1``) sums products in fp32 as `gemv` does; more rows use `tl.dot`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import dot_precision, launcher, next_pow2, use_triton


@triton.jit
def _dequant_linear_kernel(
    X, W, S, Z, Y, M, N, K, stride_x_m, stride_w_n, stride_s_n, stride_z_n, stride_y_m,
    BN: tl.constexpr, BK: tl.constexpr, INT4: tl.constexpr, HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_w_n
    s_rows = S + (offs_n // BN).to(tl.int64) * stride_s_n
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        if INT4:
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b = tl.load(w_rows + half[None, :], mask=n_mask[:, None], other=0)
            q = tl.join(b & 15, b >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
        else:
            q = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(Z + offs_n.to(tl.int64) * stride_z_n + k0 // BK, mask=n_mask, other=0)
            q -= z.to(tl.float32)[:, None]
        s = tl.load(s_rows + k0 // BK, mask=n_mask, other=0.0).to(tl.float32)
        w = q * s[:, None]
        if BLOCK_M == 1:
            x = tl.load(X + ks, mask=k_mask, other=0.0).to(tl.float32)
            acc += w * x[None, :]
        else:
            x = tl.load(X + offs_m[:, None] * stride_x_m + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    if BLOCK_M == 1:
        tl.store(Y + offs_n, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=n_mask)
    else:
        y_ptrs = Y + offs_m[:, None] * stride_y_m + offs_n[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# (BLOCK_N, BLOCK_K, num_warps) for one row, and (BLOCK_N, BLOCK_K, num_warps, num_stages) for more;
# untuned first choices (a GEMV tile streams 4-8 KB of weights a program).
GEMV_TILES = (32, 128, 4)
GEMM_TILES = (64, 64, 4, 3)


def dequant_linear_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
                          block: tuple[int, int]) -> torch.Tensor:
    """Triton version of `dequant_linear`."""
    int4 = w.dtype == torch.uint8
    N, K = w.shape[0], w.shape[1] * (2 if int4 else 1)
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    bn, bk = block
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 1:
        block_n, block_k, num_warps = GEMV_TILES
        block_m, num_stages = 1, 1
    else:
        block_n, block_k, num_warps, num_stages = GEMM_TILES
        block_m = min(64, max(16, next_pow2(M)))
    # A K step must stay inside one scale block (and, for 4-bit, cover whole bytes).
    block_k = min(block_k, bk if bk & (bk - 1) == 0 else next_pow2(bk) // 2, max(16, next_pow2(K)))
    assert bk >= K or bk % block_k == 0, f"scale blocks of {bk} columns do not fit K steps of {block_k}"
    if M:
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        launcher(_dequant_linear_kernel, x)[grid](
            rows, w, scale, zeros if zeros is not None else scale, y, M, N, K,
            rows.stride(0), w.stride(0), scale.stride(0), zeros.stride(0) if zeros is not None else 0, y.stride(0),
            BN=bn, BK=bk, INT4=int4, HAS_ZERO=zeros is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype),
            num_warps=num_warps, num_stages=num_stages,
        )
    return y.view(*x.shape[:-1], N)


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
                      block: tuple[int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[N, K]`` weight the kernel multiplies by, in ``dtype`` (the torch twin's unpacking)."""
    if w.dtype == torch.uint8:
        q = torch.stack([w & 15, w >> 4], dim=-1).reshape(w.shape[0], -1).float()
    else:
        q = w.float()
    n, k = q.shape
    bn, bk = block

    def per_element(t: torch.Tensor) -> torch.Tensor:
        return t.float().repeat_interleave(bn, 0)[:n].repeat_interleave(min(bk, k), 1)[:, :k]

    if zeros is not None:
        q = q - per_element(zeros)
    return (q * per_element(scale)).to(dtype)


def dequant_linear_torch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
                         block: tuple[int, int]) -> torch.Tensor:
    """Torch twin: dequantize this one weight, then F.linear."""
    return F.linear(x, dequantize_blocks(w, scale, zeros, block, x.dtype))


def dequant_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
                   block: tuple[int, int]) -> torch.Tensor:
    """y = x @ dequantized(w)^T for x ``[..., K]``; ``block``: the rows and columns one scale covers."""
    if use_triton(x):
        return dequant_linear_triton(x, w, scale, zeros, block)
    return dequant_linear_torch(x, w, scale, zeros, block)
