"""Batched LoRA: each token of a batch adds its own adapter's low-rank product to a projection's
output, ``y += (x @ A[slot]^T) @ B[slot]^T * scaling[slot]``, per projection group
(``lora_add``): q, k and v of one ``qkv`` output (they share x) are one shrink and one expand, as
are gate and up.

Why a split shrink, then an expand. At decode an adapter's bytes are few (rank 16 on Llama-3-8B:
about 0.5% of the weights), so what a launch costs is its slowest program's latency, and that is
set by the bytes one program reads: one SM pulls a few tens of KB a microsecond. A kernel that
shrinks inside every column chunk (``s = x @ A^T`` over the whole width K, then its chunk of ``s
@ B^T``) makes each program read all of its slot's A: 393 KB for qkv (48 x 4096 x 2 B at rank
16), 459 KB for down (16 x 14336 x 2 B), several microseconds on one SM however many programs
run beside it, and the chunks re-read the same A from L2. So:

Several rows (``lora_add``; its halves ``lora_shrink_triton`` and ``lora_expand_triton``, so
that ``LoraBatch.linear`` can run the shrink, which reads x only, on a side stream beside the
base projection):

1. ``_lora_shrink_kernel``, grid (K split, row tile): each program reads a ``K / k_splits``
   slice of its slot's A once (every projection of the group: x's slice is read once too) and
   writes its tiles' partial sums ``P[split, i, :]`` (fp32, ``[k_splits, rows, m * R]``, i the
   position in ``rows``). Every partial the sum reads is written, so nothing is zeroed first and
   nothing is added atomically. With one split it writes s itself.
2. ``_lora_sum_kernel``, one program per position: ``s[i]`` = the sum of its partials (one load
   of ``k_splits x m * R`` floats), rounded to the activations' dtype (PEFT's ``lora_A(x)`` is
   in it too). On the side stream it is hidden beside the base projection as the shrink is.
3. ``_lora_expand_kernel``, grid (column block, row tile): adds ``s @ B^T * scaling`` to its
   ``BLOCK_N`` columns of y for its tile's tokens, in place. One block a program and no loop: a
   program waits on three loads in a row (the segments' bounds; its rows and B; s and y), and a
   launch's many programs wait side by side. (Chunks of several blocks a program, looped over,
   cost 11 us a launch at batch 32.) The sum is a kernel of its own, not the expand's prologue,
   because the expand's programs are many (896 at batch 32 for gate_up, against the sum's 32):
   each summing its tokens' partials again took 156 registers a thread (64-bit addresses of a
   ``k_splits x BLOCK_M x R`` tile), 3 programs an SM, and gate_up's expand 16.4 us on an
   H200; reading s, 117 registers and 9.3 us (``lora_kernels.py``, 2026-11-28).

Or the shrink inside the base GEMM (``lora_expand_wide``: ``LoraBatch.linear``'s wide route).
Where the pool keeps every slot's A right below the dense base weight it wraps, in one tensor
(``LoraPool.widen``), one GEMM over that tensor gives the base output and, in its last ``S * m *
R`` columns, every slot's shrink of every token, rounded to the activations' dtype (as PEFT's
``lora_A(x)``); the expand reads each token's own slot's columns of it (``S_BY_ROW``). A's bytes
ride on the weight's read (1-6% more rows on Llama-3-8B with 8 rank-16 slots), with no launch,
no partials and no side stream of their own. At 32 rows over 8 adapters on an H200, a group as a
step runs it: o 17.1 us against 19.0 on the side stream, down 36.8 against 41.7, qkv and gate_up
within 0.5-0.9 us of it (``lora_kernels.py``, 2026-11-28); whole steps 0.87x the base throughput
against 0.84x. Which route is faster depends on the kernel cuBLAS picks for the wider shape, so
``LoraBatch.route`` times both once per shape and row bucket.

A row tile is ``BLOCK_M`` rows of one slot's segment: the launches' row tiles are the segments'
tiles in slot order (`_segment_tile` finds its own from all slots' bounds, one load), as many
as the rows' segments can need (``min(S, n) + cdiv(n, BLOCK_M) - 1`` for n rows). So tiles of
no tokens are few: a grid of (slot, tile of the slot's rows) up to the longest segment a graph
may replay (its bucket) had 16 tiles at batch 32 over 8 adapters, 7 of them empty, and was
0.16 ms a step slower on an H200 (`lora.py`, 7.16 against 7.00 ms).

Each launch reads A or B once in all. The host picks ``k_splits`` so that the shrink's busy
programs (splits x tiles that can hold tokens) fill about one wave of SMs, at most
``MAX_K_SPLITS`` (the sum's load grows with them), each split a whole number of ``BLOCK_K``
blocks; the expand's blocks are 256 columns (`expand_block_n`). On an H100 (132 SMs),
Llama-3-8B, rank 16, bf16, batch 32 over 8 adapters: 9 row tiles (8 segments of 4 tokens,
plus a boundary's). The shrink: qkv 11 splits of 384 columns, 99 programs, 88 of them busy, of
36 KB of A; down 14 splits of 1024, 112 busy programs of 32 KB. The expand: qkv 24 blocks x 8
segments = 192 busy programs of 8 KB of B (and 512 bytes of s); gate_up 112 x 8 = 896; o and
down 128.

One row (a batch-1 decode step, where the base projection is our GEMV, ``kernels/gemv.py``):
the expand is the GEMV's epilogue, so a projection group costs one launch more than the base
model's, not two, and gate_up keeps its activation in the same launch:

3. ``_lora_shrink_row_kernel`` (``lora_row``), a GEMV over A's rows: one program per row of A
   (``m * R``: 48 for qkv at rank 16), each reading its row whole (8 KB; 28 KB for down), writes
   the final ``s`` ``[m * R]`` (no partials: the GEMV's programs read R floats of it each).
4. The GEMV (``RowLora``), after its weight loop, reads its columns' rows of B (``BLOCK_N x R``:
   128 bytes at rank 16 beside 32 KB of weight) and of s, and adds ``s @ B^T * scaling`` to the
   rounded projection output, before the activation for gate and up. Not before the loop: the
   loads' results held through it took 96 registers a thread against the plain GEMV's 79-80
   (sm_90, bf16, default tiles: 5 programs an SM against 6, 7 for gate_up), and the GEMVs with
   the epilogue ran ~22% longer than without it on an H200 (2026-11-27). After it, the loop is
   the plain GEMV's (the same PTX; 80 registers for gemv, 72 for gate_up, as without LoRA).

The row's slot is read from ``seg_start`` itself (``row_slot``), so the graph inputs are the same.

Tokens are grouped by adapter (S-LoRA / Punica's segments): ``rows[seg_start[s] :
seg_start[s + 1]]`` are the token rows of slot ``s`` (built once a step on the host:
``llmserve.lora.pool.lora_segments``). A program loads one adapter's weights for up to
``BLOCK_M`` tokens at once (a batch of 32 over 8 adapters: one program per adapter and split or
block, not per request); a tile past the segments' (its launch's last one, when no segment
boundary falls inside a tile) exits at once, and a token of the base model is in no tile.

The pool pads every adapter to its largest rank ``R`` with zeros; ``slot_rank`` masks the
padding's loads (a masked load moves no memory). A stacks a group's projections' A
(``[S, m * R, K]``), B their B as the fused output's columns (``[S, N, R]``).

Everything the kernels read is on the device, and their grids, blocks and the partials' shape
depend on shapes only, so a step replays from a CUDA graph with ``seg_start`` and ``rows`` graph
inputs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .backend import dot_precision, launcher, next_pow2, pdl, use_triton, vector_width
from .triton_math import pdl_wait, row_chunk

# Rows of a segment per program: tl.dot's least at decode (a segment holds a few tokens); wider
# tiles for segments longer than DECODE_ROWS (prompts), which re-read A and B less often.
BLOCK_M_DECODE, BLOCK_M_PREFILL, DECODE_ROWS = 16, 64, 256
MAX_K_SPLITS = 32           # the sum reads k_splits partials a token: a few KB at most
SHRINK_BLOCK_K = 128        # the widest K block; a split is a whole number of them
_SHRINK_SMEM = 128 << 10    # bytes of shared memory the shrink's pipelined tiles may take


@triton.jit
def _segment_tile(SegStart, Rows, NUM_SLOTS, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (., t)'s tokens: the t-th tile of ``BLOCK_M`` rows of the segments in slot order
    (slot s has ``cdiv(len_s, BLOCK_M)`` of them), found from all slots' bounds at once (one load,
    then sums over ``BLOCK_S`` lanes); returns its slot (clamped to a valid one), the tile's first
    position in ``Rows`` and its slot's end (``first >= seg_end``: no tokens, the program exits),
    the positions, a mask of the real ones and their token rows."""
    tile = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    starts = tl.load(SegStart + offs_s, mask=offs_s < NUM_SLOTS, other=0)
    ends = tl.load(SegStart + 1 + offs_s, mask=offs_s < NUM_SLOTS, other=0)
    counts = (ends - starts + BLOCK_M - 1) // BLOCK_M
    # The tile's slot: the slots whose tiles all come before it (those past NUM_SLOTS count 0
    # tiles and end at the total, so a tile past the total counts them all and finds none).
    slot = tl.sum((tl.cumsum(counts, 0) <= tile).to(tl.int32), 0)
    before = tl.sum(tl.where(offs_s < slot, counts, 0), 0)
    seg_end = tl.sum(tl.where(offs_s == slot, ends, 0), 0)
    first = tl.sum(tl.where(offs_s == slot, starts, 0), 0) + (tile - before) * BLOCK_M
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    rows = tl.load(Rows + offs_m, mask=m_mask, other=0).to(tl.int64)
    return tl.minimum(slot, NUM_SLOTS - 1), first, seg_end, offs_m, m_mask, rows


@triton.jit
def _lora_shrink_kernel(X, A, P, S, Rank, SegStart, Rows, NUM_SLOTS, K, K_PER_SPLIT, K_SPLITS, R_TOTAL, R_SUB,
                        stride_xm, stride_as, stride_ar, stride_ps, stride_pm, stride_sm,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """``x[rows[i]] @ A[slot]^T`` for the tile's positions i over columns ``split * K_PER_SPLIT``
    on (at most K_PER_SPLIT of them): ``m * R_SUB x K_PER_SPLIT`` of A read once. One split: S[i]
    itself (rounded to x's dtype); more: the split's partial sums ``P[split, i]`` (fp32), which
    `_lora_sum_kernel` adds up into S."""
    # The tile's rows and the slot's rank are a step's inputs (written before the step, not by the
    # kernel before): read while that kernel ends (`pdl_wait`).
    slot, first, seg_end, offs_m, m_mask, rows = _segment_tile(SegStart, Rows, NUM_SLOTS, BLOCK_M, BLOCK_S)
    # Every projection's A rows at once: projection j's are j * R_SUB on, the slot's first
    # `rank` of them its adapter's (the rest is the pool's zero padding, not read).
    offs_r = tl.arange(0, BLOCK_R)
    r_in = offs_r < R_TOTAL
    r_mask = r_in & (offs_r % R_SUB < tl.load(Rank + slot))
    pdl_wait(PDL)
    if first >= seg_end:     # no tokens of this slot in this tile
        return
    split = tl.program_id(0)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    a_ptrs = A + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
    x_ptrs = X + rows[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        # A first: its address waits on no load, x's on the tile's rows (A's trip to memory
        # then overlaps theirs)
        a = tl.load(a_ptrs + offs_k[:, None], mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        x = tl.load(x_ptrs + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
    s_mask = m_mask[:, None] & r_in[None, :]
    if K_SPLITS == 1:
        tl.store(S + offs_m[:, None] * stride_sm + offs_r[None, :], acc.to(S.dtype.element_ty), mask=s_mask)
    else:
        tl.store(P + split.to(tl.int64) * stride_ps + offs_m[:, None] * stride_pm + offs_r[None, :], acc, mask=s_mask)


@triton.jit
def _lora_sum_kernel(P, S, K_SPLITS, R_TOTAL, stride_ps, stride_pm, stride_sm,
                     BLOCK_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """``S[i] = sum over splits of P[:, i]``, rounded to S's dtype, for position i = program_id(0):
    all of its partials in one load (``K_SPLITS x R_TOTAL`` floats, a few KB)."""
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64)
    offs_sp = tl.arange(0, BLOCK_SPLITS)
    offs_r = tl.arange(0, BLOCK_R)
    r_in = offs_r < R_TOTAL
    p = tl.load(P + offs_sp[:, None] * stride_ps + i * stride_pm + offs_r[None, :],
                mask=(offs_sp < K_SPLITS)[:, None] & r_in[None, :], other=0.0)
    tl.store(S + i * stride_sm + offs_r, tl.sum(p, 0).to(S.dtype.element_ty), mask=r_in)


@triton.jit
def _lora_expand_kernel(S, B, Y, Scaling, Rank, SegStart, Rows, NUM_SLOTS, Blocks, R_SUB,
                        stride_sm, stride_ss, stride_bs, stride_bn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                        S_BY_ROW: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """``y[rows[i], block] += s @ B[slot, block]^T * scaling`` for the tile's positions i and one
    column block: ``R x BLOCK_N`` of B. s: the projection's columns of ``S[i]`` (a shrink's
    output, by position), or with S_BY_ROW of ``S[rows[i], slot * stride_ss:]`` (the widened base
    GEMM's tail: every slot's shrink of every token row). No loop over blocks: a program waits on
    three loads in a row (the block and the segments' bounds; its rows and B; s and y), and the
    many programs of a launch wait side by side."""
    # This program's columns: block program_id(0), of projection `proj` (its s columns start at
    # proj * R_SUB), columns col_start up to col_end of y (a block never spans two projections).
    # Loaded before the segment's bounds: they do not depend on them.
    block = Blocks + tl.program_id(0) * 3
    proj = tl.load(block)
    col_start = tl.load(block + 1)
    col_end = tl.load(block + 2)
    slot, first, seg_end, offs_m, m_mask, rows = _segment_tile(SegStart, Rows, NUM_SLOTS, BLOCK_M, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < tl.load(Rank + slot)
    offs_n = col_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_end
    # B, the block table and the step's segments are not the kernel before's writes (s and y
    # are): read while it ends (`pdl_wait`). A tile without tokens reads no B (masked off).
    b = tl.load(B + slot.to(tl.int64) * stride_bs + offs_r[:, None] + offs_n[None, :] * stride_bn,
                mask=(r_mask[:, None] & n_mask[None, :]) & (first < seg_end), other=0.0)
    pdl_wait(PDL)
    if first >= seg_end:
        return
    y_ptrs = Y + rows[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if S_BY_ROW:
        s_ptrs = S + rows[:, None] * stride_sm + slot.to(tl.int64) * stride_ss
    else:
        s_ptrs = S + offs_m[:, None] * stride_sm
    s = tl.load(s_ptrs + (proj * R_SUB + offs_r)[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    delta = tl.dot(s, b, input_precision=DOT_PRECISION) * tl.load(Scaling + slot)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=mask)


# -- one row: the shrink alone, the expand in the GEMV's epilogue (kernels/gemv.py) -------------

@triton.jit
def row_slot(SegStart, NUM_SLOTS, BLOCK_S: tl.constexpr):
    """The slot of a one-row batch's row, clamped to a valid index, and whether it has one (the
    base model's row is in no segment). ``seg_start`` is 0 up to the row's slot and 1 after it,
    so the slot is the count of zeros in ``seg_start[1:]``: one load, none depending on it."""
    offs = tl.arange(0, BLOCK_S)
    later = tl.load(SegStart + 1 + offs, mask=offs < NUM_SLOTS, other=1)
    slot = tl.sum((later == 0).to(tl.int32), 0)
    return tl.minimum(slot, NUM_SLOTS - 1), slot < NUM_SLOTS


@triton.jit
def slot_value(Values, slot, NUM_SLOTS, BLOCK_S: tl.constexpr):
    """``Values[slot]``, read as all slots' values at once: the load goes out beside `row_slot`'s
    rather than after it (one latency less on the program's way)."""
    offs = tl.arange(0, BLOCK_S)
    values = tl.load(Values + offs, mask=offs < NUM_SLOTS, other=0)
    return tl.sum(tl.where(offs == slot, values, 0), 0)


@triton.jit
def _lora_shrink_row_kernel(X, A, S, Rank, SegStart, NUM_SLOTS, K, R_TOTAL, R_SUB, stride_as, stride_ar,
                            BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                            VEC: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """``S[j] = x . A[slot, j]`` (rounded to x's dtype, stored in fp32) for BLOCK_J rows j of A:
    a GEMV over A's rows, each program reading its rows whole, so s is final (no partials to sum
    downstream). Padding rows past the slot's rank read nothing and store 0."""
    pdl_wait(PDL)
    slot, has = row_slot(SegStart, NUM_SLOTS, BLOCK_S)
    rank = slot_value(Rank, slot, NUM_SLOTS, BLOCK_S)
    if not has:
        return
    offs_j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_in = offs_j < R_TOTAL
    j_mask = j_in & (offs_j % R_SUB < rank)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + slot.to(tl.int64) * stride_as + offs_j[:, None] * stride_ar + offs_k[None, :]
    # As the GEMV's loop (kernels/gemv.py): each thread sums its own 16-byte groups, an even K
    # masks whole rows only, and each chunk's loads go out before the previous chunk's sums. A
    # full-tile accumulator summed as the loads came in made sm_90 issue a chunk 16 bytes a thread
    # at a time, each load waited on before the next went out (4 trips to memory a chunk, not 1).
    acc = tl.zeros([BLOCK_J, BLOCK_K // VEC], tl.float32)
    a, x = row_chunk(a_ptrs, X, 0, K, offs_k, j_mask, EVEN_K, FIRST=True)
    for k0 in range(BLOCK_K, K + BLOCK_K, BLOCK_K):     # the chunk past K: all masked off
        a_next, x_next = row_chunk(a_ptrs, X, k0, K, offs_k, j_mask, EVEN_K)
        acc += tl.sum(tl.reshape(a.to(tl.float32) * x.to(tl.float32)[None, :], [BLOCK_J, BLOCK_K // VEC, VEC]), 2)
        a = a_next
        x = x_next
    s = tl.sum(acc, 1).to(X.dtype.element_ty)    # PEFT's lora_A(x) is in the activations' dtype
    tl.store(S + offs_j, s.to(tl.float32), mask=j_in)


@triton.jit
def row_lora_loads(LoraS, LoraB, Scaling, SegStart, NUM_SLOTS, cols, proj, n_mask, R_SUB, stride_bs, stride_bn,
                   BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """What a one-row GEMV program needs to add the adapter's product to its output columns
    ``cols`` (of projections ``proj``): s's rows ``[BLOCK_N, BLOCK_R]``, B's ``[BLOCK_N,
    BLOCK_R]`` and the slot's scaling, zeros when the row has no adapter. Loads only (a GEMV
    calls it after its weight loop, then the cross-lane sums overlap them; `row_lora_delta`)."""
    slot, has = row_slot(SegStart, NUM_SLOTS, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    # The pool keeps A's rows and B's columns past an adapter's rank at zero, so s @ B^T needs no
    # rank mask (at most R_SUB x BLOCK_N of B a program, a few hundred bytes).
    mask = n_mask[:, None] & (offs_r < R_SUB)[None, :] & has
    s = tl.load(LoraS + proj[:, None] * R_SUB + offs_r[None, :], mask=mask, other=0.0)
    # int32 columns (one slot's B is under 2**31 elements, RowLora asserts): a GEMV's int64 offs_n
    # would be computed before its loop, and held through it, for this epilogue.
    b = tl.load(LoraB + slot.to(tl.int64) * stride_bs + (cols[:, None] * stride_bn + offs_r[None, :]),
                mask=mask, other=0.0)
    return s, b, slot_value(Scaling, slot, NUM_SLOTS, BLOCK_S)


@triton.jit
def row_lora_delta(s, b, scaling):
    """``s @ B^T * scaling`` for a GEMV program's columns, in fp32 (the loads of `row_lora_loads`)."""
    return tl.sum(s * b.to(tl.float32), 1) * scaling


@dataclass(frozen=True)
class RowLora:
    """A one-row batch's adapter product, for a GEMV to add in its epilogue (`gemv_triton`,
    `gemv_act_and_mul_triton`): the shrink's output ``s`` ``[m * r_sub]`` (fp32, `lora_row`),
    the group's B ``[S, N, R]`` and ``scaling`` ``[S]``, and ``seg_start`` (which slot the row
    is in: none, and nothing is added). ``splits``: the projections' output widths."""

    s: torch.Tensor
    b: torch.Tensor
    scaling: torch.Tensor
    seg_start: torch.Tensor
    splits: tuple[int, ...]
    r_sub: int

    def kernel_args(self) -> tuple:
        """The GEMV kernels' LoRA arguments: ``LoraS, LoraB, Scaling, SegStart, NUM_SLOTS,
        SPLIT1, SPLIT2, R_SUB, stride_bs, stride_bn`` (output column n is of projection
        ``(n >= SPLIT1) + (n >= SPLIT2)``)."""
        assert len(self.splits) <= 3 and self.b.stride(2) == 1, "at most 3 projections, unit-stride B rows"
        assert self.b[0].numel() < 2**31, "row_lora_loads indexes one slot's B in int32"
        n = sum(self.splits)
        bounds = [sum(self.splits[: j + 1]) for j in range(len(self.splits) - 1)] + [n, n]
        return (self.s, self.b, self.scaling, self.seg_start, self.seg_start.numel() - 1, bounds[0], bounds[1],
                self.r_sub, self.b.stride(0), self.b.stride(1))

    def constexprs(self) -> dict:
        return dict(BLOCK_R=max(16, next_pow2(self.r_sub)), BLOCK_S=max(2, next_pow2(self.seg_start.numel() - 1)))


def no_row_lora(t: torch.Tensor) -> tuple[tuple, dict]:
    """The GEMV kernels' LoRA arguments without an adapter: pointers never read (``t``), zeros."""
    return (t, t, t, t, 1, 0, 0, 1, 0, 0), dict(BLOCK_R=16, BLOCK_S=2)


# The one-row shrink's widest K block (all of a row of A up to 16384 columns in flight at once:
# down's 14336 in one trip to memory, not two) and its rows of A a program.
ROW_SHRINK_BLOCK_K, ROW_SHRINK_ROWS = 16384, 1


def lora_row(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, slot_rank: torch.Tensor,
             seg_start: torch.Tensor, splits: tuple[int, ...], r_sub: int) -> RowLora:
    """The shrink of a one-row batch ``x`` ``[1, K]`` (`lora_add`'s arguments, Triton only): one
    program per row of A (``m * r_sub`` of them, the padding's exiting after one load of the
    rank), each reading its row whole; returns what the GEMV's epilogue adds (`RowLora`)."""
    k = x.shape[-1]
    assert x.numel() == k and x.stride(-1) == 1 and a.stride(2) == 1, "one unit-stride row"
    r_total = a.shape[1]
    s = torch.empty(r_total, dtype=torch.float32, device=x.device)
    num_slots = seg_start.numel() - 1
    block_k = min(ROW_SHRINK_BLOCK_K, max(16, next_pow2(k)))
    launcher(_lora_shrink_row_kernel, x)[(triton.cdiv(r_total, ROW_SHRINK_ROWS),)](
        x, a, s, slot_rank, seg_start, num_slots, k, r_total, r_sub, a.stride(0), a.stride(1),
        BLOCK_J=ROW_SHRINK_ROWS, BLOCK_K=block_k, BLOCK_S=max(2, next_pow2(num_slots)),
        VEC=vector_width(x, block_k), EVEN_K=k % block_k == 0, num_warps=max(4, min(16, block_k // 1024)),
        **pdl(x),
    )
    return RowLora(s, b, scaling, seg_start, tuple(splits), r_sub)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Programs in one wave (the interpreter's CPU gets a few, so its tests take many K splits)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_BLOCK_TABLES: dict[tuple, torch.Tensor] = {}


def _block_table(splits: tuple[int, ...], block_n: int, device: torch.device) -> torch.Tensor:
    """(projection, first column, end column) of each ``block_n``-column block of an output made
    of projections of ``splits`` columns (a projection's last block may be short): made once per
    shape and device, so a step replayed from a CUDA graph reads a tensor that lives as long as
    the process (the first, uncaptured run makes it)."""
    key = (splits, block_n, str(device))
    if key not in _BLOCK_TABLES:
        rows, start = [], 0
        for j, n in enumerate(splits):
            rows += [(j, c, min(c + block_n, start + n)) for c in range(start, start + n, block_n)]
            start += n
        _BLOCK_TABLES[key] = torch.tensor(rows, dtype=torch.int32).to(device)
    return _BLOCK_TABLES[key]


@dataclass(frozen=True)
class ShrinkPlan:
    """How the shrink cuts K: ``k_splits`` programs a tile, each ``k_per_split`` columns (a whole
    number of ``block_k`` blocks; the last split takes what is left), pipelined ``num_stages`` deep."""

    block_k: int
    k_per_split: int
    k_splits: int
    num_stages: int


def shrink_plan(k: int, busy: int, block_m: int, block_r: int, elem_size: int, num_sms: int) -> ShrinkPlan:
    """The K splits of a shrink whose ``busy`` tiles can hold tokens: enough that splits x tiles
    fill about one wave of ``num_sms`` (at most MAX_K_SPLITS). A program's loads are what it waits
    on, so its blocks are as wide as 3 pipelined stages of x's and A's tiles (``(block_m +
    block_r) x block_k``) allow in _SHRINK_SMEM, up to SHRINK_BLOCK_K."""
    stage_bytes = (block_m + block_r) * elem_size
    block_k = max(16, min(SHRINK_BLOCK_K, next_pow2(k), next_pow2(_SHRINK_SMEM // (3 * stage_bytes) + 1) // 2))
    blocks = triton.cdiv(k, block_k)
    target = max(1, min(MAX_K_SPLITS, triton.cdiv(num_sms, busy)))
    blocks_per_split = triton.cdiv(blocks, target)
    num_stages = max(2, min(4, _SHRINK_SMEM // (stage_bytes * block_k)))
    return ShrinkPlan(block_k, blocks_per_split * block_k, triton.cdiv(blocks, blocks_per_split), num_stages)


def expand_block_n(splits: tuple[int, ...]) -> int:
    """The expand's columns a program: 256 (8 KB of B at rank 16), never wider than the narrowest
    projection needs. `benchmarks/lora_kernels.py --sweep` on an H200, batch 32 over 8 adapters,
    each launch alone, 4 warps: 2.2-2.7 us for qkv, o and down at 256 columns, 2.4-2.8 at 128,
    2.9-3.4 at 512; gate_up 9.2-9.6 at all three (2026-11-28, the expand reading s)."""
    return min(max(16, next_pow2(min(splits))), 256)


@dataclass(frozen=True)
class Shrunk:
    """A shrink's output ``s`` ``[n, m * R]`` (x's dtype; position i of ``rows`` at row i, for the
    positions the segments hold) and the launch shape its expand shares."""

    s: torch.Tensor
    # The fp32 partials s was summed from: held until the expand, which runs after the caller's
    # join of the side stream the shrink may run on (freed sooner, the allocator could hand
    # their memory to the main stream while the sum still reads them).
    partials: torch.Tensor
    block_m: int
    tiles: int      # row tiles of the launches (the most the segments of the rows can need)


def _row_tiles(n: int, num_slots: int, max_len: int) -> tuple[int, int]:
    """The rows a tile (``BLOCK_M``) and the row tiles of the launches over n rows' segments of at
    most ``max_len`` rows: at most the rows' tiles plus one per segment boundary (a sum of ceilings
    exceeds the sum's ceiling by less than one a term), a count of shapes only, so a CUDA graph's
    launches fit every step it replays."""
    block_m = BLOCK_M_DECODE if max_len <= DECODE_ROWS else BLOCK_M_PREFILL
    return block_m, min(num_slots, n) + triton.cdiv(n, block_m) - 1


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slot_rank: torch.Tensor, seg_start: torch.Tensor,
                       rows: torch.Tensor, max_len: int, splits: tuple[int, ...], r_sub: int,
                       stream: torch.cuda.Stream | None = None, num_warps: int | None = None) -> Shrunk | None:
    """`lora_add`'s first half: ``s = x @ A^T`` per segment, split over K (None: no tokens have an
    adapter's segment to be in). ``stream``: launch it there (s and the partials are allocated on
    the current stream, which the caller joins before the expand)."""
    n, k = x.shape
    num_slots = seg_start.numel() - 1
    if n == 0 or num_slots == 0 or max_len == 0:
        return None
    assert x.stride(1) == 1 and a.stride(2) == 1
    sms = _num_sms(x.device)
    block_m, tiles = _row_tiles(n, num_slots, max_len)
    r_total = len(splits) * r_sub
    block_r = max(16, next_pow2(r_total))
    plan = shrink_plan(k, tiles, block_m, block_r, x.element_size(), sms)
    # A position of ``rows`` that a segment holds is below n (each of the batch's n rows is in one
    # segment at most), and a graph's ``rows`` may be longer than its bucket (the largest's tail,
    # padded): s, the partials and the sum cover the first n positions only.
    s = torch.empty((n, r_total), dtype=x.dtype, device=x.device)
    partials = torch.empty((plan.k_splits if plan.k_splits > 1 else 0, n, r_total), dtype=torch.float32,
                           device=x.device)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        launcher(_lora_shrink_kernel, x)[(plan.k_splits, tiles)](
            x, a, partials, s, slot_rank, seg_start, rows, num_slots, k, plan.k_per_split, plan.k_splits,
            r_total, r_sub, x.stride(0), a.stride(0), a.stride(1), partials.stride(0), partials.stride(1), s.stride(0),
            BLOCK_M=block_m, BLOCK_K=plan.block_k, BLOCK_R=block_r, BLOCK_S=max(2, next_pow2(num_slots)),
            DOT_PRECISION=dot_precision(x.dtype),
            num_stages=plan.num_stages, num_warps=num_warps or (8 if block_m * block_r >= 8192 else 4),
            **pdl(x),
        )
        if plan.k_splits > 1:
            block_splits = next_pow2(plan.k_splits)
            launcher(_lora_sum_kernel, x)[(n,)](
                partials, s, plan.k_splits, r_total, partials.stride(0), partials.stride(1), s.stride(0),
                BLOCK_SPLITS=block_splits, BLOCK_R=block_r, num_warps=max(1, min(4, block_splits * block_r // 256)),
                **pdl(x),
            )
    return Shrunk(s, partials, block_m, tiles)


def lora_expand_triton(y: torch.Tensor, shrunk: Shrunk, b: torch.Tensor, scaling: torch.Tensor,
                       slot_rank: torch.Tensor, seg_start: torch.Tensor, rows: torch.Tensor,
                       splits: tuple[int, ...], r_sub: int, block_n: int | None = None,
                       num_warps: int | None = None) -> None:
    """`lora_add`'s second half: ``y += s @ B^T * scaling`` (``block_n``, ``num_warps``: other
    tiles than the default's, for benchmarks/lora_kernels.py)."""
    _expand(y, shrunk.s, 0, False, shrunk.block_m, shrunk.tiles, b, scaling, slot_rank, seg_start, rows, splits, r_sub,
            block_n, num_warps)


def lora_expand_wide_triton(y: torch.Tensor, s_all: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                            slot_rank: torch.Tensor, seg_start: torch.Tensor, rows: torch.Tensor, max_len: int,
                            splits: tuple[int, ...], r_sub: int) -> None:
    """Triton version of `lora_expand_wide`."""
    n, num_slots = y.shape[0], seg_start.numel() - 1
    if n == 0 or num_slots == 0 or max_len == 0:
        return
    assert s_all.stride(1) == 1 and s_all.shape[1] == num_slots * len(splits) * r_sub
    block_m, tiles = _row_tiles(n, num_slots, max_len)
    _expand(y, s_all, len(splits) * r_sub, True, block_m, tiles, b, scaling, slot_rank, seg_start, rows, splits,
            r_sub)


def _expand(y: torch.Tensor, s: torch.Tensor, slot_stride: int, s_by_row: bool, block_m: int, tiles: int,
            b: torch.Tensor, scaling: torch.Tensor, slot_rank: torch.Tensor, seg_start: torch.Tensor,
            rows: torch.Tensor, splits: tuple[int, ...], r_sub: int, block_n: int | None = None,
            num_warps: int | None = None) -> None:
    """The expand's launch over ``tiles`` row tiles of ``block_m`` rows, reading s by position (a
    shrink's output) or, with ``s_by_row``, by token row and slot (``slot_stride`` columns a slot)."""
    assert y.stride(1) == 1 and b.stride(2) == 1
    block_n = block_n or expand_block_n(splits)
    blocks = _block_table(tuple(splits), block_n, y.device)
    num_slots = seg_start.numel() - 1
    launcher(_lora_expand_kernel, y)[(blocks.shape[0], tiles)](
        s, b, y, scaling, slot_rank, seg_start, rows, num_slots, blocks, r_sub,
        s.stride(0), slot_stride, b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(r_sub)), BLOCK_S=max(2, next_pow2(num_slots)),
        S_BY_ROW=s_by_row, DOT_PRECISION=dot_precision(y.dtype), num_warps=num_warps or 4,
        **pdl(y),
    )


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                    slot_rank: torch.Tensor, seg_start: torch.Tensor, rows: torch.Tensor, max_len: int,
                    splits: tuple[int, ...], r_sub: int) -> None:
    """Triton version of `lora_add`: the shrink (split over K, its partials summed), then the expand."""
    shrunk = lora_shrink_triton(x, a, slot_rank, seg_start, rows, max_len, splits, r_sub)
    if shrunk is not None:
        lora_expand_triton(y, shrunk, b, scaling, slot_rank, seg_start, rows, splits, r_sub)


def lora_add_torch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                   slot_rank: torch.Tensor, seg_start: torch.Tensor, rows: torch.Tensor, max_len: int,
                   splits: tuple[int, ...], r_sub: int) -> None:
    """Torch twin of `lora_add`, computed as PEFT's ``result + lora_B(lora_A(x)) * scaling``, each
    projection on its own, at the adapter's own rank."""
    def shrink(slot: int, idx: torch.Tensor, rank: int) -> list[torch.Tensor]:
        xs = x.index_select(0, idx)
        return [xs @ a[slot, j * r_sub : j * r_sub + rank].t() for j in range(len(splits))]

    _expand_torch(y, shrink, b, scaling, slot_rank, seg_start, rows, splits)


def _expand_torch(y: torch.Tensor, shrink: Callable[[int, torch.Tensor, int], list[torch.Tensor]], b: torch.Tensor,
                  scaling: torch.Tensor, slot_rank: torch.Tensor, seg_start: torch.Tensor, rows: torch.Tensor,
                  splits: tuple[int, ...]) -> None:
    """The twins' expand: ``y[t] += s_j @ B[slot, projection j's columns, :rank]^T * scaling`` for
    each slot's token rows t and projection j, ``shrink(slot, rows, rank)`` giving the s_j."""
    starts = seg_start.tolist()
    for slot in range(len(starts) - 1):
        if starts[slot] == starts[slot + 1]:
            continue
        idx = rows[starts[slot] : starts[slot + 1]].long()
        rank, scale = int(slot_rank[slot]), float(scaling[slot])
        col = 0
        for s, width in zip(shrink(slot, idx, rank), splits):
            delta = (s @ b[slot, col : col + width, :rank].t()) * scale
            y[idx, col : col + width] = y[:, col : col + width].index_select(0, idx) + delta
            col += width


def lora_expand_wide_torch(y: torch.Tensor, s_all: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                           slot_rank: torch.Tensor, seg_start: torch.Tensor, rows: torch.Tensor, max_len: int,
                           splits: tuple[int, ...], r_sub: int) -> None:
    """Torch twin of `lora_expand_wide`, each projection on its own, at the adapter's own rank."""
    width = len(splits) * r_sub

    def own_slots_columns(slot: int, idx: torch.Tensor, rank: int) -> list[torch.Tensor]:
        s = s_all.index_select(0, idx)[:, slot * width : (slot + 1) * width]
        return [s[:, j * r_sub : j * r_sub + rank] for j in range(len(splits))]

    _expand_torch(y, own_slots_columns, b, scaling, slot_rank, seg_start, rows, splits)


def lora_expand_wide(y: torch.Tensor, s_all: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                     slot_rank: torch.Tensor, seg_start: torch.Tensor, rows: torch.Tensor, max_len: int,
                     splits: tuple[int, ...], r_sub: int) -> None:
    """`lora_add`'s expand from every slot's shrink of every token: ``s_all`` ``[n, S * m *
    r_sub]`` (token row t's ``x[t] @ A[s]^T`` at columns ``s * m * r_sub`` on, in y's dtype: the
    tail of a base GEMM whose weight has every slot's A below it, ``LoraPool.widen``), of which
    each token of slot s's segment adds its own slot's ``s_all[t, slot's columns] @ B[s]^T *
    scaling[s]`` to y (the other slots' columns are not read)."""
    if use_triton(y):
        lora_expand_wide_triton(y, s_all, b, scaling, slot_rank, seg_start, rows, max_len, splits, r_sub)
    else:
        lora_expand_wide_torch(y, s_all, b, scaling, slot_rank, seg_start, rows, max_len, splits, r_sub)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
             slot_rank: torch.Tensor, seg_start: torch.Tensor, rows: torch.Tensor, max_len: int,
             splits: tuple[int, ...] | None = None, r_sub: int | None = None) -> None:
    """``y[t] += x[t] @ A[s]^T @ B[s]^T * scaling[s]`` in place for each token row t of each
    adapter slot s, per projection.

    x ``[n, K]``; y ``[n, N]`` (unit-stride rows; it may be a column slice of a wider tensor) is m
    projections' outputs side by side, ``splits`` their widths (None: one projection); A ``[S, m *
    r_sub, K]`` (projection j's rows from ``j * r_sub``, of which the slot's first ``slot_rank[s]``
    are its adapter's; r_sub None: A's rows split evenly between the projections); B ``[S, N, R]`` (the
    projections' B stacked as y's columns); scaling ``[S]`` float32. Slot s's tokens are rows
    ``rows[seg_start[s] : seg_start[s + 1]]`` (``seg_start`` ``[S + 1]``, int32), at most
    ``max_len`` of them; a row in no segment (the base model's) is left as it is."""
    splits = tuple(splits) if splits is not None else (y.shape[1],)
    r_sub = r_sub or a.shape[1] // len(splits)
    if use_triton(y):
        lora_add_triton(y, x, a, b, scaling, slot_rank, seg_start, rows, max_len, splits, r_sub)
    else:
        lora_add_torch(y, x, a, b, scaling, slot_rank, seg_start, rows, max_len, splits, r_sub)
