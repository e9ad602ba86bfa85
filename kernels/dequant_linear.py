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

- one row (`_dequant_gemv_kernel`, a batch-1 decode step): the weight's read is the whole cost,
  and a read is as fast as the bytes a program keeps in flight. A thread holds one 16-byte chunk
  of each of its rows (16 FP8 values, or four words of eight 4-bit ones) and sums the chunk's
  products inside the thread, into one float a (row, chunk), reduced across threads once at the
  end; the scale of a chunk's group multiplies its sum, a per-channel scale the row's. (An
  accumulator a value, as `gemv.py`'s bf16 tile has, capped a thread at 64 values in flight:
  64 bytes of FP8, 32 of 4-bit, against bf16's 128.) 4-bit values are unpacked with one LOP3
  and one FADD each (`_int4_values`), and their zero point comes off the chunk's sum
  (s * (sum q x - z * sum x)). With ``ACT`` the kernel is a gated MLP's gate_up with its
  activation (`dequant_gemv_act_and_mul`), as `gemv.gemv_act_and_mul` is for bf16.
- more rows (`_dequant_gemm_kernel`): each weight tile is dequantized once into the activations'
  dtype and multiplied on the tensor cores (`tl.dot`) by every row of x. The weight tile is the
  dot's first operand (y^T = W x^T), so a step of a few rows still fills the MMA's 64-row side.

Their tiles are autotuned per shape, format and row bucket (`kernels/autotune.py`). Compiled for
sm_90 (Triton 3.7's ptxas, on a CPU) no config spills registers; the GEMV's FP8 tiles take 66-168
registers, its 4-bit ones 126-255 with ~1.2 integer and ~2.4 FP32 instructions a value and no
shared memory in the loop; the GEMM's 4-bit tiles ~2 integer instructions and 2 FMAs a value, and
its tiles of 64+ weight rows run on wgmma.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import autotune
from .backend import dot_precision, next_pow2, use_triton
from .gemv import ACTIVATIONS
from .triton_math import gelu_tanh, pdl_wait, silu

@triton.jit
def _weight_tile(W, S, Z, offs_n, n_mask, k0, K, KW, stride_w_n, stride_s_n, stride_z_n,
                 SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr, HAS_ZERO: tl.constexpr,
                 EVEN_K: tl.constexpr, NG: tl.constexpr, GK: tl.constexpr):
    """The weight's columns k0 .. k0 + NG * GK of rows ``offs_n``, float32 ``[BLOCK_N, NG, GK]``
    (column k0 + g * GK + j): (q - z) * s, or q - z where one scale covers a row (GROUP 0)."""
    g = tl.arange(0, NG)
    stored = k0 // PACK + g[:, None] * (GK // PACK) + tl.arange(0, GK // PACK)[None, :]
    ptrs = W + offs_n[:, None, None].to(tl.int64) * stride_w_n + stored[None, :, :]
    if EVEN_K:
        raw = tl.load(ptrs, mask=n_mask[:, None, None], other=0.0)
    else:
        raw = tl.load(ptrs, mask=n_mask[:, None, None] & (stored < KW)[None, :, :], other=0.0)
    in_k = n_mask[:, None] & (k0 + g * GK < K)[None, :]
    if GROUP != 0:
        s = tl.load(S + (offs_n // SCALE_ROWS)[:, None].to(tl.int64) * stride_s_n + (k0 // GROUP + g)[None, :],
                    mask=in_k, other=0.0).to(tl.float32)
    if PACK == 8:
        # 4-bit values, eight to an int32 word (value i in bits 4i..4i+3). Each is shifted into the
        # mantissa of 1024.0 at bits 13-16, where a unit is 1: OR-ing gives 1024 + q exactly, in
        # two integer instructions and no integer-to-float conversion. tl.join keeps a word's
        # eight values in its thread.
        m = 0x1E000
        n0, n1 = ((raw << 13) & m) | 0x44800000, ((raw << 9) & m) | 0x44800000
        n2, n3 = ((raw << 5) & m) | 0x44800000, ((raw << 1) & m) | 0x44800000
        n4, n5 = ((raw >> 3) & m) | 0x44800000, ((raw >> 7) & m) | 0x44800000
        n6, n7 = ((raw >> 11) & m) | 0x44800000, ((raw >> 15) & m) | 0x44800000
        # tl.join appends an axis: value 4c + 2a + b of a word lands at [c, a, b].
        eight = tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)), tl.join(tl.join(n1, n5), tl.join(n3, n7)))
        q = tl.reshape(eight, [raw.shape[0], NG, GK]).to(tl.float32, bitcast=True)
        if HAS_ZERO:
            if GROUP == 0:
                z = tl.load(Z + offs_n.to(tl.int64) * stride_z_n, mask=n_mask, other=0)[:, None]
            else:
                z = tl.load(Z + offs_n[:, None].to(tl.int64) * stride_z_n + (k0 // GROUP + g)[None, :],
                            mask=in_k, other=0)
            offset = 1024.0 + z.to(tl.float32)
        else:
            offset = tl.full([1, 1], 1024.0, tl.float32)
        if GROUP != 0:
            # (1024 + z) * s is exact in float32 for a half-precision s (11 + 11 bits), so one
            # FMA gives (q - z) * s rounded once.
            w = q * s[:, :, None] - (offset * s)[:, :, None]
        else:
            w = q - offset[:, :, None]
    else:
        w = raw.to(tl.float32)
        if GROUP != 0:
            w = w * s[:, :, None]
    return w


@triton.jit
def _row_scales(S, offs_n, n_mask, stride_s_n, SCALE_ROWS: tl.constexpr):
    return tl.load(S + (offs_n // SCALE_ROWS).to(tl.int64) * stride_s_n, mask=n_mask, other=0.0).to(tl.float32)


# 2^7's bits, passed to the GEMV at run time (see `_int4_values`).
TWO_TO_7 = 0x43000000


@triton.jit
def _int4_values(raw, two_to_7):
    """The eight 4-bit values of each int32 word of ``raw`` as exact float32 integers 0..15,
    joined so that reshaping the result's last three axes gives them in column order.

    Value i (bits 4i..4i+3) is OR-ed, where it lies, into the mantissa of the power of two whose
    unit there is 1 (2^23 for bits 0-3, 2^19 for 4-7, ... 2^7 for 16-19), and that power is
    subtracted: one LOP3 and one FADD a value, where a shift, two logic ops and an FMA were
    (the INT pipe, 64 lanes an SM against the FP32 pipe's 128, bounds a 4-bit GEMV). Values 5-7
    are first shifted down 12 bits (one shift a word) to reuse the masks of values 2-4. The
    powers' bits come from ``two_to_7``, a run-time argument (`TWO_TO_7`): a LOP3 takes one
    immediate, and with both the mask and the power constant the compiler emits an AND and an OR."""
    hi = raw >> 12
    p11 = two_to_7 + (4 << 23)
    p15 = two_to_7 + (8 << 23)
    p19 = two_to_7 + (12 << 23)
    p23 = two_to_7 + (16 << 23)
    q0 = ((raw & 0xF) | p23).to(tl.float32, bitcast=True) - 8388608.0
    q1 = ((raw & 0xF0) | p19).to(tl.float32, bitcast=True) - 524288.0
    q2 = ((raw & 0xF00) | p15).to(tl.float32, bitcast=True) - 32768.0
    q3 = ((raw & 0xF000) | p11).to(tl.float32, bitcast=True) - 2048.0
    q4 = ((raw & 0xF0000) | two_to_7).to(tl.float32, bitcast=True) - 128.0
    q5 = ((hi & 0xF00) | p15).to(tl.float32, bitcast=True) - 32768.0
    q6 = ((hi & 0xF000) | p11).to(tl.float32, bitcast=True) - 2048.0
    q7 = ((hi & 0xF0000) | two_to_7).to(tl.float32, bitcast=True) - 128.0
    # tl.join appends an axis: value 4c + 2a + b of a word lands at [c, a, b].
    return tl.join(tl.join(tl.join(q0, q4), tl.join(q2, q6)), tl.join(tl.join(q1, q5), tl.join(q3, q7)))


@triton.jit
def _x_chunks(X, k0, K, chunk, CV: tl.constexpr, START: tl.constexpr, WIDTH: tl.constexpr, EVEN_K: tl.constexpr):
    """x's columns START .. START + WIDTH of each chunk of CV columns from k0, float32 ``[C, WIDTH]``."""
    offs = k0 + chunk[:, None] * CV + START + tl.arange(0, WIDTH)[None, :]
    if EVEN_K:
        return tl.load(X + offs).to(tl.float32)
    return tl.load(X + offs, mask=offs < K, other=0.0).to(tl.float32)


@triton.jit
def _word_dot(word, X, k0, K, chunk, index: tl.constexpr, two_to_7, BLOCK_N: tl.constexpr, C: tl.constexpr,
              CV: tl.constexpr, EVEN_K: tl.constexpr):
    """Word ``index`` of each chunk (``word`` ``[BLOCK_N, C]``, columns 8 * index .. + 8 of the
    chunk) against x: sum q x ``[BLOCK_N, C]`` and sum x ``[C]``."""
    x = _x_chunks(X, k0, K, chunk, CV, 8 * index, 8, EVEN_K)
    q = tl.reshape(_int4_values(word, two_to_7), [BLOCK_N, C, 8])
    return tl.sum(q * x[None, :, :], 2), tl.sum(x, 1)


@triton.jit
def _raw_chunk(w_ptrs, n_mask, k0, K, KW, stored, PACK: tl.constexpr, EVEN_K: tl.constexpr,
               IN_K: tl.constexpr = False):
    """The stored weight of the K step at ``k0`` (``w_ptrs`` already there), zeros past K: a step
    past K moves no memory (as `row_chunk`'s). IN_K: the step is known to start inside K."""
    if EVEN_K and IN_K:
        return tl.load(w_ptrs, mask=n_mask[:, None, None], other=0.0)
    if EVEN_K:
        return tl.load(w_ptrs, mask=n_mask[:, None, None] & (k0 < K), other=0.0)
    return tl.load(w_ptrs, mask=n_mask[:, None, None] & (k0 // PACK + stored < KW)[None, :, :], other=0.0)


@triton.jit
def _gemv_rows(X, W, S, Z, offs_n, n_mask, K, KW, stride_w_n, stride_s_n, stride_z_n, two_to_7,
               SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr, HAS_ZERO: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CV: tl.constexpr, EVEN_K: tl.constexpr,
               PREFETCH: tl.constexpr):
    """x . W[n] for the rows ``offs_n``, float32 ``[BLOCK_N]``, scales applied.

    The K step is C chunks of CV columns, each chunk one 16-byte load of a row (16 FP8 values or
    four words of 4-bit ones) held by one thread, so a chunk's products are summed inside the
    thread (an FMA chain: one FMA a value) and the accumulator is one float a (row, chunk): the
    registers a thread spends on accumulating no longer grow with the values it has in flight,
    so a tile can keep as many bytes in flight as the bf16 GEMV does (128-256 a thread). A chunk
    lies in one scale group (CV <= GROUP), so its scale and zero point multiply its sum:
    s * (sum q x - z * sum x), sum x computed once a chunk for every row.

    With PREFETCH a step's weight loads are issued before the previous step's sums (as
    `gemv.py`'s loop: two tiles in flight a program, on twice the registers for them); without,
    the loads of a step wait behind its sums. Which wins depends on how many programs an SM then
    holds, so it is one of the autotuned choices."""
    C: tl.constexpr = BLOCK_K // CV
    V: tl.constexpr = CV // PACK                                   # stored elements a chunk
    chunk = tl.arange(0, C)
    stored = chunk[:, None] * V + tl.arange(0, V)[None, :]        # [C, V], from k0 / PACK
    w_ptrs = W + offs_n[:, None, None].to(tl.int64) * stride_w_n + stored[None, :, :]
    acc = tl.zeros([BLOCK_N, C], tl.float32)
    if PREFETCH:
        raw_next = _raw_chunk(w_ptrs, n_mask, 0, K, KW, stored, PACK, EVEN_K, IN_K=True)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            raw = raw_next
            raw_next = _raw_chunk(w_ptrs + BLOCK_K // PACK, n_mask, k0 + BLOCK_K, K, KW, stored, PACK, EVEN_K)
        else:
            raw = _raw_chunk(w_ptrs, n_mask, k0, K, KW, stored, PACK, EVEN_K, IN_K=True)
        if PACK == 8:
            # x as four [C, 8] loads, one a word: each is 16 bytes of a thread (as the weight
            # tile's layout wants them), where one [C, 32] load would be spread over four
            # threads and moved through shared memory every step. The words likewise: split
            # inside the thread.
            pair0, pair1 = tl.split(tl.reshape(raw, [BLOCK_N, C, 2, 2]))     # words (0, 2), (1, 3)
            word0, word2 = tl.split(pair0)
            word1, word3 = tl.split(pair1)
            part, xsum = _word_dot(word0, X, k0, K, chunk, 0, two_to_7, BLOCK_N, C, CV, EVEN_K)
            p1, s1 = _word_dot(word1, X, k0, K, chunk, 1, two_to_7, BLOCK_N, C, CV, EVEN_K)
            p2, s2 = _word_dot(word2, X, k0, K, chunk, 2, two_to_7, BLOCK_N, C, CV, EVEN_K)
            p3, s3 = _word_dot(word3, X, k0, K, chunk, 3, two_to_7, BLOCK_N, C, CV, EVEN_K)
            part += p1 + p2 + p3
            xsum += s1 + s2 + s3
        else:
            x = _x_chunks(X, k0, K, chunk, CV, 0, CV, EVEN_K)
            part = tl.sum(raw.to(tl.float32) * x[None, :, :], 2)    # [BLOCK_N, C], inside threads
            xsum = tl.sum(x, 1)
        in_k = n_mask[:, None] & (k0 + chunk * CV < K)[None, :]
        if HAS_ZERO:
            if GROUP == 0:
                z = tl.load(Z + offs_n.to(tl.int64) * stride_z_n, mask=n_mask, other=0)[:, None]
            else:
                z = tl.load(Z + offs_n[:, None].to(tl.int64) * stride_z_n + ((k0 + chunk * CV) // GROUP)[None, :],
                            mask=in_k, other=0)
            part -= z.to(tl.float32) * xsum[None, :]
        if GROUP != 0:
            s = tl.load(S + (offs_n // SCALE_ROWS)[:, None].to(tl.int64) * stride_s_n
                        + ((k0 + chunk * CV) // GROUP)[None, :], mask=in_k, other=0.0).to(tl.float32)
            part *= s
        acc += part
        w_ptrs += BLOCK_K // PACK
    y = tl.sum(acc, 1)
    if GROUP == 0:
        y = y * _row_scales(S, offs_n, n_mask, stride_s_n, SCALE_ROWS)
    return y


@triton.jit
def _dequant_gemv_kernel(
    X, W, S, Z, Y, N, K, KW, stride_w_n, stride_s_n, stride_z_n, TWO_TO_7,
    SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr, HAS_ZERO: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CV: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    # ACT "": Y[n] = x . W[n] for n < N. ACT "silu" / "gelu_tanh" (a gated MLP's gate_up, W of
    # 2N rows): Y[n] = act(x . W[n]) * (x . W[N + n]), rounded as `gemv.py`'s act-and-mul is.
    pdl_wait(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    y = _gemv_rows(X, W, S, Z, offs_n, n_mask, K, KW, stride_w_n, stride_s_n, stride_z_n, TWO_TO_7,
                   SCALE_ROWS, GROUP, PACK, HAS_ZERO, BLOCK_N, BLOCK_K, CV, EVEN_K, PREFETCH)
    if ACT != "":
        up = _gemv_rows(X, W, S, Z, offs_n + N, n_mask, K, KW, stride_w_n, stride_s_n, stride_z_n, TWO_TO_7,
                        SCALE_ROWS, GROUP, PACK, HAS_ZERO, BLOCK_N, BLOCK_K, CV, EVEN_K, PREFETCH)
        gate = y.to(Y.dtype.element_ty).to(tl.float32)
        if ACT == "gelu_tanh":
            act = gelu_tanh(gate)
        else:
            act = silu(gate)
        y = act.to(Y.dtype.element_ty).to(tl.float32) * up.to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_mask)


@triton.jit
def _dequant_gemm_kernel(
    X, W, S, Z, Y, M, N, K, KW, ROWS, stride_x_m, stride_w_n, stride_s_n, stride_z_n, stride_y_m,
    SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr, HAS_ZERO: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NG: tl.constexpr, GK: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    # ROWS (the row bucket) is only the autotuner's key.
    pdl_wait(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[None, :].to(tl.int64) * stride_x_m + offs_k[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _weight_tile(W, S, Z, offs_n, n_mask, k0, K, KW, stride_w_n, stride_s_n, stride_z_n,
                         SCALE_ROWS, GROUP, PACK, HAS_ZERO, EVEN_K, NG, GK)
        w = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(X.dtype.element_ty)
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


# One row, by PACK (values a stored element): (BLOCK_N, BLOCK_K, num_warps, PREFETCH). A thread
# holds one 16-byte chunk of each of BLOCK_N * C / (32 * num_warps) rows (C = BLOCK_K / CV chunks
# a step): 128 bytes a thread a step for 4 x 2048 FP8 or 4 x 4096 4-bit, as gemv.py's bf16 tile
# (4 x 2048 x 2 bytes over 128 threads). From `benchmarks/quantized_gemv.py --rows 1 --sweep --wide` on an H100
# (2026-11-27, 40 tiles a format on Llama-3-8B's four layer shapes): these hold each shape's best
# or come within 1% of it. 4 rows a program won everywhere but FP8 qkv (8 x 1024, by 1%);
# PREFETCH (two steps in flight, at 128-255 registers) never won for FP8 and won 4-bit's o and
# down by 1-5%; tiles of 16-32 rows or 256 bytes a thread lost 10-60%. 16 x 2048 stays for cards
# with more bandwidth an SM (an H200), which want more bytes in flight. On an H200 the FP8 step
# at one row went from 3.00 ms (the tiles before that cut: 16-32 rows, 8 warps) to 3.63 with
# these alone (2026-11-28), so FP8 keeps those wider tiles and two PREFETCH ones to choose from.
GEMV_TILES = {
    1: [(4, 2048, 4, False), (8, 1024, 4, False), (4, 4096, 4, False), (8, 2048, 4, False), (16, 2048, 4, False),
        (16, 1024, 4, False), (16, 2048, 8, False), (32, 1024, 8, False), (4, 2048, 4, True), (8, 2048, 4, True)],
    8: [(4, 4096, 4, False), (4, 4096, 4, True), (8, 2048, 4, False), (8, 4096, 4, False), (16, 2048, 4, False)],
}
_GEMV_BY_PACK = {pack: [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "PREFETCH": prefetch}, num_warps=w, num_stages=1)
                        for n, k, w, prefetch in tiles]
                 for pack, tiles in GEMV_TILES.items()}
GEMV_CONFIGS = [c for configs in _GEMV_BY_PACK.values() for c in configs]
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
    it: K steps of NG groups of GK columns, or a group of several steps; whether
    K needs no mask. Steps far wider than K are dropped while narrower ones remain."""
    out = []
    for c in configs:
        block_k = c.kwargs["BLOCK_K"]
        gk = min(block_k, GROUP) if GROUP else block_k
        sizes = {"NG": block_k // gk, "GK": gk, "EVEN_K": K % block_k == 0}
        out.append(triton.Config({**c.kwargs, **sizes}, num_warps=c.num_warps, num_stages=c.num_stages))
    return _fitting(out, K)


def _fitting(configs: list[triton.Config], K: int) -> list[triton.Config]:
    """Of ``configs``, those whose K step is not far wider than K, or else the narrowest."""
    narrow = [c for c in configs if c.kwargs["BLOCK_K"] <= max(64, next_pow2(K))]
    return narrow or [min(configs, key=lambda c: c.kwargs["BLOCK_K"])]


# Columns a GEMV chunk (one 16-byte load of a row) holds, by PACK. A 4-bit chunk is four words
# and must lie in one scale group: groups of 8 or 16 columns take the GEMM (`takes_gemv`).
CHUNK = {1: 16, 8: 32}


def takes_gemv(constexprs: dict) -> bool:
    """Whether `_dequant_gemv_kernel` takes a weight of this `kernel_layout`."""
    return constexprs["PACK"] == 1 or not constexprs["GROUP"] or constexprs["GROUP"] >= CHUNK[8]


def _prune_gemv(configs, nargs, GROUP: int, PACK: int, **_):
    """This format's tiles whose K step suits K (as `_complete`'s), with their chunk width and
    whether K needs no mask."""
    K = nargs["K"]
    cv = min(CHUNK[PACK], GROUP) if GROUP else CHUNK[PACK]
    out = [triton.Config({**c.kwargs, "CV": cv, "EVEN_K": K % c.kwargs["BLOCK_K"] == 0},
                         num_warps=c.num_warps, num_stages=c.num_stages) for c in _GEMV_BY_PACK[PACK]]
    return _fitting(out, K)


def _prune_gemm(configs, nargs, **constexprs):
    return _complete(_GEMM_BY_ROWS[min(nargs["ROWS"], max(GEMM_TILES))], nargs["K"], **constexprs)


_gemv = autotune.autotune(GEMV_CONFIGS, key=["N", "K", "GROUP", "SCALE_ROWS", "ACT"], prune=_prune_gemv)(_dequant_gemv_kernel)
_gemm = autotune.autotune(GEMM_CONFIGS, key=["N", "K", "ROWS", "GROUP", "SCALE_ROWS"], prune=_prune_gemm)(_dequant_gemm_kernel)


def kernel_layout(w: torch.Tensor, block: tuple[int, int]) -> dict | None:
    """The constexprs that say the weight's format (PACK: values a stored element), or None for
    a layout the kernels do not take (a scale group that is not a power of two narrower than K):
    the torch twin runs those."""
    int4 = w.dtype == torch.uint8
    pack = 8 if int4 else 1
    k = w.shape[1] * (2 if int4 else 1)
    group = block[1] if block[1] < k else 0
    if group and (group & (group - 1) or group % pack):
        return None
    if int4 and (k % 8 or w.stride(1) != 1 or w.stride(0) % 4 or w.storage_offset() % 4):
        return None
    return {"SCALE_ROWS": block[0], "GROUP": group, "PACK": pack}


def stored(w: torch.Tensor) -> torch.Tensor:
    """The weight as the kernels read it: 4-bit values as int32 words of eight (value i of a word
    in bits 4i..4i+3, as the bytes' nibbles are ordered)."""
    return w.view(torch.int32) if w.dtype == torch.uint8 else w


def _launch_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
                 constexprs: dict, y: torch.Tensor, act: str, config: triton.Config | None) -> None:
    """`_dequant_gemv_kernel` on the row ``x`` (unit stride) into ``y``'s ``N`` features."""
    N, K = y.shape[-1], x.shape[-1]
    zs = zeros if zeros is not None else scale
    args = {"X": x, "W": w, "S": scale, "Z": zs, "Y": y, "N": N, "K": K, "KW": w.shape[1],
            "stride_w_n": w.stride(0), "stride_s_n": scale.stride(0), "stride_z_n": zs.stride(0), "TWO_TO_7": TWO_TO_7}
    constexprs = constexprs | {"HAS_ZERO": zeros is not None, "ACT": act}
    autotune.launch(_gemv, x, lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),), args, constexprs, config)


def dequant_linear_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
                          block: tuple[int, int], *, config: triton.Config | None = None) -> torch.Tensor:
    """Triton version of `dequant_linear` (the twin where `kernel_layout` says the kernels cannot);
    ``config`` forces a tile (tests, benchmarks) instead of the autotuner's choice: a GEMM tile
    (one with BLOCK_M) runs the GEMM even at one row."""
    constexprs = kernel_layout(w, block)
    if constexprs is None:
        return dequant_linear_torch(x, w, scale, zeros, block)
    N, K = w.shape[0], w.shape[1] * (2 if w.dtype == torch.uint8 else 1)
    w = stored(w)
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*x.shape[:-1], N)
    if M == 1 and takes_gemv(constexprs) and (config is None or "BLOCK_M" not in config.kwargs):
        _launch_gemv(rows, w, scale, zeros, constexprs, y, "", config)
        return y.view(*x.shape[:-1], N)
    zs = zeros if zeros is not None else scale
    constexprs["HAS_ZERO"] = zeros is not None
    args = {"X": rows, "W": w, "S": scale, "Z": zs, "Y": y, "M": M, "N": N, "K": K, "KW": w.shape[1],
            "ROWS": autotune.rows_bucket(M), "stride_x_m": rows.stride(0), "stride_w_n": w.stride(0),
            "stride_s_n": scale.stride(0), "stride_z_n": zs.stride(0), "stride_y_m": y.stride(0)}
    constexprs["PRECISION"] = dot_precision(x.dtype)
    autotune.launch(_gemm, x, lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, meta["BLOCK_M"])),
                    args, constexprs, config)
    return y.view(*x.shape[:-1], N)


def dequant_gemv_act_and_mul_torch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                                   zeros: torch.Tensor | None, block: tuple[int, int], act: str) -> torch.Tensor:
    """Torch twin of `dequant_gemv_act_and_mul`: the linear layer, then the activation's twin."""
    return ACTIVATIONS[act](dequant_linear_torch(x, w, scale, zeros, block))


def dequant_gemv_act_and_mul_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                                    zeros: torch.Tensor | None, block: tuple[int, int], act: str, *,
                                    config: triton.Config | None = None) -> torch.Tensor:
    """Triton version of `dequant_gemv_act_and_mul` (the twin where `kernel_layout` says the
    kernel cannot, or where a scale block would hold rows of both gate and up)."""
    assert act in ACTIVATIONS, act
    constexprs = kernel_layout(w, block)
    I = w.shape[0] // 2
    if constexprs is None or not takes_gemv(constexprs) or I % block[0]:
        return ACTIVATIONS[act](dequant_linear_triton(x, w, scale, zeros, block))
    assert x.numel() == x.shape[-1] and x.stride(-1) == 1, "one unit-stride row"
    y = torch.empty(*x.shape[:-1], I, dtype=x.dtype, device=x.device)
    _launch_gemv(x.reshape(1, -1), stored(w), scale, zeros, constexprs, y.view(1, I), act, config)
    return y


def dequant_gemv_act_and_mul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
                             block: tuple[int, int], act: str) -> torch.Tensor:
    """``act(gate) * up`` of the one-row `dequant_linear` with ``w`` ``[2I, K]`` (gate's rows, then
    up's), act ``"silu"`` or ``"gelu_tanh"``: `gemv.gemv_act_and_mul` for quantized weights, one
    launch where the linear layer and `silu_and_mul_fwd` took two. Returns ``[..., I]``."""
    if use_triton(x):
        return dequant_gemv_act_and_mul_triton(x, w, scale, zeros, block, act)
    return dequant_gemv_act_and_mul_torch(x, w, scale, zeros, block, act)


def configs_for(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> list[triton.Config]:
    """Every config the autotuner would try for this call (tests run each; benchmarks time each)."""
    constexprs = kernel_layout(w, block)
    K = stored(w).shape[1] * constexprs["PACK"]
    M = x.numel() // K
    if M == 1 and takes_gemv(constexprs):
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
