"""Linear layer on a weight stored in 8 or 4 bits with scales per block: the weight is dequantized
tile by tile inside the kernel, never whole in memory.

It serves the formats whose bytes, not their arithmetic, make them fast: block-wise FP8
(DeepSeek / Qwen3-FP8: float8 values, a scale per 128 x 128 tile), 4-bit AWQ / GPTQ (a scale and a
zero point per group of 128 columns of a row) and the one-row step of per-channel FP8 (where
quantizing the activations would buy nothing: the step is the weight's read).

Storage (``llmserve.quantization.weights``): ``W`` float8 ``[N, K]``, or uint8 ``[N, K / 2]`` with
column 2j in byte j's low nibble and 2j + 1 in its high one; ``S`` the scales ``[ceil(N / BN),
ceil(K / BK)]``, one per ``(BN, BK)`` block; ``Z`` (4-bit only) integer zero points ``[N, K / BK]``.
Value = (q - z) * s.

Two kernels, both reading the weight in its own layout:

- one row (`_dequant_gemv_kernel`, a batch-1 decode step): the weight's read is the whole cost, so
  it is written as `gemv.py` is: programs of a few output rows each (hundreds to thousands of
  programs for every Llama-3-8B shape, enough to fill 132 SMs without splitting K), wide loads
  along K, products summed in fp32 into a tile reduced once at the end. What is particular to
  quantized weights is the arithmetic a loaded byte costs, which at 4 bits rivals the read:
  four-bit values are read as int32 words of eight, and each becomes a float by OR-ing it into
  the mantissa of 2^23 (an integer-to-float conversion is a quarter-rate instruction), its zero
  point likewise, so q - z is one exact subtraction; a group's scale multiplies the sum of its
  eight products, not each of them; one scale a row (per-channel FP8) multiplies the row's sum.
- more rows (`_dequant_gemm_kernel`): each weight tile is dequantized once into the activations'
  dtype and multiplied on the tensor cores (`tl.dot`) by every row of x. The weight tile is the
  dot's first operand (y^T = W x^T), so a step of a few rows still fills the MMA's 64-row side.

Both tile the K axis as ``[NG, GW, PACK]``: NG scale groups of GW stored words of PACK values (8
for 4-bit, 1 for FP8), so a group's scale and zero point are loaded once per row and broadcast.
Their tiles are autotuned per shape, format and row bucket (`kernels/autotune.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import autotune
from .backend import dot_precision, next_pow2, use_triton

MAGIC = 0x4B000000          # the bits of 2^23: OR-ing an integer 0..2^23 into it gives 2^23 + that integer


@triton.jit
def _weight_tile(W, Z, offs_n, n_mask, k0, K, KW, stride_w_n, stride_z_n,
                 GROUP: tl.constexpr, PACK: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
                 NG: tl.constexpr, GK: tl.constexpr, GW: tl.constexpr):
    """The weight's columns k0 .. k0 + NG * GK of rows ``offs_n`` as exact float32 q - z,
    ``[BLOCK_N, NG, GW, PACK]`` (column k0 + g * GK + w * PACK + p)."""
    g = tl.arange(0, NG)
    word = k0 // PACK + g[:, None] * GW + tl.arange(0, GW)[None, :]
    ptrs = W + offs_n[:, None, None].to(tl.int64) * stride_w_n + word[None, :, :]
    if EVEN_K:
        raw = tl.load(ptrs, mask=n_mask[:, None, None], other=0.0)
    else:
        raw = tl.load(ptrs, mask=n_mask[:, None, None] & (word < KW)[None, :, :], other=0.0)
    if PACK == 8:
        shifts = tl.arange(0, 8) * 4
        q = (((raw[:, :, :, None] >> shifts[None, None, None, :]) & 15) | 0x4B000000).to(tl.float32, bitcast=True)
        if HAS_ZERO:
            if GROUP == 0:
                z = tl.load(Z + offs_n.to(tl.int64) * stride_z_n, mask=n_mask, other=0)[:, None]
            else:
                z_ptrs = Z + offs_n[:, None].to(tl.int64) * stride_z_n + (k0 // GROUP + g)[None, :]
                z = tl.load(z_ptrs, mask=n_mask[:, None] & (k0 + g * GK < K)[None, :], other=0)
            zf = (z.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
            q = q - zf[:, :, None, None]
        else:
            q = q - 8388608.0
    else:
        q = raw.to(tl.float32)[:, :, :, None]
    return q


@triton.jit
def _group_scales(S, offs_n, n_mask, k0, K, stride_s_n, SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr,
                  NG: tl.constexpr, GK: tl.constexpr):
    """The scales of the NG groups from column k0, float32 ``[BLOCK_N, NG]``."""
    g = tl.arange(0, NG)
    ptrs = S + (offs_n // SCALE_ROWS)[:, None].to(tl.int64) * stride_s_n + (k0 // GROUP + g)[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & (k0 + g * GK < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _row_scales(S, offs_n, n_mask, stride_s_n, SCALE_ROWS: tl.constexpr):
    return tl.load(S + (offs_n // SCALE_ROWS).to(tl.int64) * stride_s_n, mask=n_mask, other=0.0).to(tl.float32)


@triton.jit
def _dequant_gemv_kernel(
    X, W, S, Z, Y, N, K, KW, stride_w_n, stride_s_n, stride_z_n,
    SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr, HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NG: tl.constexpr, GK: tl.constexpr, GW: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # x's columns in the weight tile's [NG, GW, PACK] order
    offs_x = (tl.arange(0, NG)[:, None, None] * GK + tl.arange(0, GW)[None, :, None] * PACK
              + tl.arange(0, PACK)[None, None, :])
    acc = tl.zeros([BLOCK_N, NG, GW], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q = _weight_tile(W, Z, offs_n, n_mask, k0, K, KW, stride_w_n, stride_z_n,
                         GROUP, PACK, HAS_ZERO, EVEN_K, NG, GK, GW)
        if EVEN_K:
            x = tl.load(X + k0 + offs_x).to(tl.float32)
        else:
            x = tl.load(X + k0 + offs_x, mask=k0 + offs_x < K, other=0.0).to(tl.float32)
        part = tl.sum(q * x[None, :, :, :], 3)          # a stored word's products (PACK of them)
        if GROUP != 0:
            part = part * _group_scales(S, offs_n, n_mask, k0, K, stride_s_n, SCALE_ROWS, GROUP, NG, GK)[:, :, None]
        acc += part
    y = tl.sum(tl.sum(acc, 2), 1)
    if GROUP == 0:
        y = y * _row_scales(S, offs_n, n_mask, stride_s_n, SCALE_ROWS)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_mask)


@triton.jit
def _dequant_gemm_kernel(
    X, W, S, Z, Y, M, N, K, KW, ROWS, stride_x_m, stride_w_n, stride_s_n, stride_z_n, stride_y_m,
    SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr, HAS_ZERO: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NG: tl.constexpr, GK: tl.constexpr,
    GW: tl.constexpr, EVEN_K: tl.constexpr,
):
    # ROWS (the row bucket) is only the autotuner's key.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[None, :].to(tl.int64) * stride_x_m + offs_k[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q = _weight_tile(W, Z, offs_n, n_mask, k0, K, KW, stride_w_n, stride_z_n,
                         GROUP, PACK, HAS_ZERO, EVEN_K, NG, GK, GW)
        if GROUP != 0:
            q = q * _group_scales(S, offs_n, n_mask, k0, K, stride_s_n, SCALE_ROWS, GROUP, NG, GK)[:, :, None, None]
        w = tl.reshape(q, [BLOCK_N, BLOCK_K]).to(X.dtype.element_ty)
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        else:
            xt = tl.load(x_ptrs, mask=m_mask[None, :] & (k0 + offs_k < K)[:, None], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
    if GROUP == 0:
        acc = acc * _row_scales(S, offs_n, n_mask, stride_s_n, SCALE_ROWS)[:, None]
    y_ptrs = Y + offs_m[None, :].to(tl.int64) * stride_y_m + offs_n[:, None]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def _config(block_n: int, block_k: int, num_warps: int, num_stages: int, block_m: int | None = None) -> triton.Config:
    sizes = {"BLOCK_N": block_n, "BLOCK_K": block_k} | ({} if block_m is None else {"BLOCK_M": block_m})
    return triton.Config(sizes, num_warps=num_warps, num_stages=num_stages)


# One row: (BLOCK_N, BLOCK_K, num_warps, num_stages). Each keeps 64 stored values a thread in flight
# (as gemv.py's bf16 tile does), from 4 rows x 2048 columns to 32 x 256, plus one pipelined.
GEMV_CONFIGS = [_config(*t) for t in [(4, 2048, 4, 1), (8, 1024, 4, 1), (16, 1024, 8, 1), (16, 512, 4, 1),
                                      (4, 4096, 8, 1), (8, 1024, 4, 3)]]
# More rows, by row bucket (`autotune.rows_bucket`): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
# num_stages). Up to 64 rows BLOCK_M is the bucket; few rows want small BLOCK_N (programs enough
# for 132 SMs) and deep pipelines; 128 rows and more (the last entry) the usual GEMM tiles.
GEMM_TILES = {
    16: [(16, 16, 256, 2, 4), (16, 32, 128, 4, 4), (16, 32, 256, 4, 3), (16, 64, 128, 4, 4), (16, 64, 64, 4, 6)],
    32: [(32, 32, 128, 4, 4), (32, 64, 128, 4, 4), (32, 64, 64, 4, 5), (32, 128, 128, 8, 3)],
    64: [(64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3)],
    128: [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 128, 4, 4),
          (128, 64, 128, 4, 4)],
}
_GEMM_BY_ROWS = {rows: [_config(n, k, w, s, block_m=m) for m, n, k, w, s in tiles] for rows, tiles in GEMM_TILES.items()}
GEMM_CONFIGS = [c for configs in _GEMM_BY_ROWS.values() for c in configs]


def _complete(configs: list[triton.Config], K: int, GROUP: int, PACK: int, **_) -> list[triton.Config]:
    """The configs whose K step suits this weight, completed with the sizes the kernels derive from
    it: K steps of NG groups of GK columns (GW stored words), or a group of several steps; whether
    K needs no mask. Steps far wider than K are dropped while narrower ones remain."""
    out = []
    for c in configs:
        block_k = c.kwargs["BLOCK_K"]
        gk = min(block_k, GROUP) if GROUP else block_k
        sizes = {"NG": block_k // gk, "GK": gk, "GW": gk // PACK, "EVEN_K": K % block_k == 0}
        out.append(triton.Config({**c.kwargs, **sizes}, num_warps=c.num_warps, num_stages=c.num_stages))
    narrow = [c for c in out if c.kwargs["BLOCK_K"] <= max(64, next_pow2(K))]
    return narrow or [min(out, key=lambda c: c.kwargs["BLOCK_K"])]


def _prune_gemv(configs, nargs, **constexprs):
    return _complete(configs, nargs["K"], **constexprs)


def _prune_gemm(configs, nargs, **constexprs):
    return _complete(_GEMM_BY_ROWS[min(nargs["ROWS"], max(GEMM_TILES))], nargs["K"], **constexprs)


_gemv = autotune.autotune(GEMV_CONFIGS, key=["N", "K", "GROUP", "SCALE_ROWS"], prune=_prune_gemv)(_dequant_gemv_kernel)
_gemm = autotune.autotune(GEMM_CONFIGS, key=["N", "K", "ROWS", "GROUP", "SCALE_ROWS"], prune=_prune_gemm)(_dequant_gemm_kernel)


def kernel_layout(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, dict] | None:
    """The weight as the kernels read it (4-bit as int32 words of eight values) and the constexprs
    that say its format; None for a layout they do not take (a group that is not a power of two
    narrower than K, 4-bit rows not a whole number of words): the torch twin runs those."""
    int4 = w.dtype == torch.uint8
    pack = 8 if int4 else 1
    k = w.shape[1] * (2 if int4 else 1)
    group = block[1] if block[1] < k else 0
    if group and (group & (group - 1) or group % pack):
        return None
    if int4:
        if k % 8 or w.stride(1) != 1 or w.stride(0) % 4 or w.storage_offset() % 4:
            return None
        w = w.view(torch.int32)
    return w, {"SCALE_ROWS": block[0], "GROUP": group, "PACK": pack}


def dequant_linear_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
                          block: tuple[int, int], *, config: triton.Config | None = None) -> torch.Tensor:
    """Triton version of `dequant_linear` (the twin where `kernel_layout` says the kernels cannot);
    ``config`` forces a tile (tests, benchmarks) instead of the autotuner's choice."""
    layout = kernel_layout(w, scale, block)
    if layout is None:
        return dequant_linear_torch(x, w, scale, zeros, block)
    words, constexprs = layout
    N, K = w.shape[0], w.shape[1] * (2 if w.dtype == torch.uint8 else 1)
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*x.shape[:-1], N)
    zs = zeros if zeros is not None else scale
    constexprs["HAS_ZERO"] = zeros is not None
    common = {"X": rows, "W": words, "S": scale, "Z": zs, "Y": y}
    if M == 1:
        args = common | {"N": N, "K": K, "KW": words.shape[1], "stride_w_n": words.stride(0),
                         "stride_s_n": scale.stride(0), "stride_z_n": zs.stride(0)}
        autotune.launch(_gemv, x, lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),), args, constexprs, config)
    else:
        args = common | {"M": M, "N": N, "K": K, "KW": words.shape[1], "ROWS": autotune.rows_bucket(M),
                         "stride_x_m": rows.stride(0), "stride_w_n": words.stride(0), "stride_s_n": scale.stride(0),
                         "stride_z_n": zs.stride(0), "stride_y_m": y.stride(0)}
        constexprs["PRECISION"] = dot_precision(x.dtype)
        autotune.launch(_gemm, x, lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, meta["BLOCK_M"])),
                        args, constexprs, config)
    return y.view(*x.shape[:-1], N)


def configs_for(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> list[triton.Config]:
    """Every config the autotuner would try for this call (tests run each; benchmarks time each)."""
    words, constexprs = kernel_layout(w, scale, block)
    K = words.shape[1] * constexprs["PACK"]
    M = x.numel() // K
    if M == 1:
        return _prune_gemv(_gemv.configs, {"K": K}, **constexprs)
    return _prune_gemm(_gemm.configs, {"K": K, "ROWS": autotune.rows_bucket(M)}, **constexprs)


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
