"""Batched LoRA: each request of a batch adds its own adapter's low-rank product to a projection's
output, ``y += (x @ A[slot]^T) @ B[slot]^T * scaling[slot]``, in two kernels (S-LoRA / Punica's
segmented shrink and expand):

- ``lora_shrink``: ``s = x @ A[slot]^T``, ``[n, R]``, for the rows of each request that has an
  adapter (``b_slot[i] >= 0``); the rows of the others are not written (expand skips them too).
- ``lora_expand``: ``y += s @ B[slot]^T * scaling[slot]``, in place, into a fused projection's
  output: q, k and v of one ``qkv`` are one shrink and one expand, B stacked in the output's
  column order, each projection's columns reading its own ``R_SUB`` columns of ``s``.

A request's new tokens are its segment: rows ``b_start[i] : b_start[i] + b_len[i]`` (the batch's
packing, ``InferStateInfo.b_q_start`` / ``b_q_len``), so one program handles a tile of one
segment's rows with one adapter's weights. The pool pads every adapter to the largest rank ``R``
with zeros; ``slot_rank`` lets the kernels skip the padding (masked loads move no memory). An A
may stack several projections' A (``[S, m * R_SUB, K]``: one shrink for q, k and v), each padded
to ``R_SUB`` rows.

Everything the kernels read is on the device (no host value depends on the adapters in the
batch), so a step replays from a CUDA graph with ``b_slot`` a graph input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import dot_precision, launcher, next_pow2, use_triton

BLOCK_M = 16   # rows of a segment per program (tl.dot's least)


@triton.jit
def _segment_tile(B_start, B_len, B_slot, BLOCK_M: tl.constexpr):
    """This program's rows: tile ``program_id(1)`` of segment ``program_id(0)``. Returns the
    segment's adapter slot, whether the program is idle (no adapter, or no rows in the tile), the
    rows and their mask."""
    req = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_M
    slot = tl.load(B_slot + req)
    length = tl.load(B_len + req)
    rows = tl.load(B_start + req) + first + tl.arange(0, BLOCK_M)
    return slot, (slot < 0) | (first >= length), rows, first + tl.arange(0, BLOCK_M) < length


@triton.jit
def _lora_shrink_kernel(X, A, S, B_start, B_len, B_slot, Rank, K, R_TOTAL, R_SUB,
                        stride_xm, stride_as, stride_ar, stride_sm,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    slot, idle, rows, row_mask = _segment_tile(B_start, B_len, B_slot, BLOCK_M)
    if idle:
        return
    rank = tl.load(Rank + slot)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_in = offs_r < R_TOTAL
    r_mask = r_in & (offs_r % R_SUB < rank)
    a_base = A + slot.to(tl.int64) * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None], mask=r_mask[None, :] & k_mask[:, None],
                    other=0.0)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
    tl.store(S + rows[:, None].to(tl.int64) * stride_sm + offs_r[None, :], acc.to(S.dtype.element_ty),
             mask=row_mask[:, None] & r_in[None, :])


@triton.jit
def _lora_expand_kernel(S, B, Y, Scaling, B_start, B_len, B_slot, Rank, Blocks, R_SUB,
                        stride_sm, stride_bs, stride_bn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    # Column block i of the output: projection Blocks[3i] (its columns of s start at j * R_SUB),
    # columns Blocks[3i + 1] up to Blocks[3i + 2] (a block never spans two projections).
    slot, idle, rows, row_mask = _segment_tile(B_start, B_len, B_slot, BLOCK_M)
    if idle:
        return
    rank = tl.load(Rank + slot)
    scaling = tl.load(Scaling + slot)
    block = Blocks + tl.program_id(2) * 3
    proj = tl.load(block)
    offs_n = tl.load(block + 1) + tl.arange(0, BLOCK_N)
    n_mask = offs_n < tl.load(block + 2)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    s = tl.load(S + rows[:, None].to(tl.int64) * stride_sm + proj * R_SUB + offs_r[None, :],
                mask=row_mask[:, None] & r_mask[None, :], other=0.0)
    b = tl.load(B + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    delta = tl.dot(s, b, input_precision=DOT_PRECISION) * scaling
    y_ptrs = Y + rows[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(Y.dtype.element_ty), mask=mask)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, b_start: torch.Tensor, b_len: torch.Tensor,
                       b_slot: torch.Tensor, slot_rank: torch.Tensor, max_len: int, r_sub: int) -> torch.Tensor:
    """Triton version of `lora_shrink`."""
    n, k = x.shape
    r_total = a.shape[1]
    s = torch.empty((n, r_total), dtype=x.dtype, device=x.device)
    if n == 0 or b_slot.numel() == 0:
        return s
    block_r = max(16, min(64, next_pow2(r_total)))
    block_k = 128 if k >= 128 else max(16, next_pow2(k))
    grid = (b_slot.numel(), triton.cdiv(max_len, BLOCK_M), triton.cdiv(r_total, block_r))
    launcher(_lora_shrink_kernel, x)[grid](
        x, a, s, b_start, b_len, b_slot, slot_rank, k, r_total, r_sub,
        x.stride(0), a.stride(0), a.stride(1), s.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k, DOT_PRECISION=dot_precision(x.dtype),
    )
    return s


_BLOCK_TABLES: dict[tuple, torch.Tensor] = {}


def _block_table(splits: tuple[int, ...], block_n: int, device: torch.device) -> torch.Tensor:
    """(projection, first column, end column) of each column block of an output made of
    projections of ``splits`` columns: made once per shape and device, so a step replayed from a
    CUDA graph reads a tensor that lives as long as the process (the first, uncaptured run makes it)."""
    key = (splits, block_n, str(device))
    if key not in _BLOCK_TABLES:
        rows, start = [], 0
        for j, n in enumerate(splits):
            rows += [(j, c, start + n) for c in range(start, start + n, block_n)]
            start += n
        _BLOCK_TABLES[key] = torch.tensor(rows, dtype=torch.int32).to(device)
    return _BLOCK_TABLES[key]


def lora_expand_triton(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                       b_start: torch.Tensor, b_len: torch.Tensor, b_slot: torch.Tensor, slot_rank: torch.Tensor,
                       max_len: int, splits: tuple[int, ...]) -> None:
    """Triton version of `lora_expand`."""
    n, cols = y.shape
    if n == 0 or b_slot.numel() == 0:
        return
    block_n = 64 if min(splits) >= 64 else max(16, next_pow2(min(splits)))
    blocks = _block_table(tuple(splits), block_n, y.device)
    grid = (b_slot.numel(), triton.cdiv(max_len, BLOCK_M), blocks.shape[0])
    launcher(_lora_expand_kernel, y)[grid](
        s, b, y, scaling, b_start, b_len, b_slot, slot_rank, blocks, s.shape[1] // len(splits),
        s.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(b.shape[2])),
        DOT_PRECISION=dot_precision(y.dtype),
    )


def _segments(b_start: torch.Tensor, b_len: torch.Tensor, b_slot: torch.Tensor) -> dict[int, torch.Tensor]:
    """slot -> the rows of every segment that uses it (the twins group a slot's rows into one matmul)."""
    rows: dict[int, list[torch.Tensor]] = {}
    for start, length, slot in zip(b_start.tolist(), b_len.tolist(), b_slot.tolist()):
        if slot >= 0 and length > 0:
            rows.setdefault(slot, []).append(torch.arange(start, start + length))
    return {slot: torch.cat(r).to(b_start.device) for slot, r in rows.items()}


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, b_start: torch.Tensor, b_len: torch.Tensor,
                      b_slot: torch.Tensor, slot_rank: torch.Tensor, max_len: int, r_sub: int) -> torch.Tensor:
    """Torch twin of `lora_shrink`, computed as PEFT's ``lora_A(x)`` (at the adapter's own rank)."""
    s = torch.zeros((x.shape[0], a.shape[1]), dtype=x.dtype, device=x.device)
    for slot, rows in _segments(b_start, b_len, b_slot).items():
        rank = int(slot_rank[slot])
        xs = x.index_select(0, rows)
        for j in range(0, a.shape[1], r_sub):
            s[rows, j : j + rank] = xs @ a[slot, j : j + rank].t()
    return s


def lora_expand_torch(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                      b_start: torch.Tensor, b_len: torch.Tensor, b_slot: torch.Tensor, slot_rank: torch.Tensor,
                      max_len: int, splits: tuple[int, ...]) -> None:
    """Torch twin of `lora_expand`, computed as PEFT's ``result + lora_B(s) * scaling``, each
    projection on its own."""
    r_sub = s.shape[1] // len(splits)
    for slot, rows in _segments(b_start, b_len, b_slot).items():
        rank = int(slot_rank[slot])
        s_rows = s.index_select(0, rows)
        col = 0
        for j, n in enumerate(splits):
            delta = (s_rows[:, j * r_sub : j * r_sub + rank] @ b[slot, col : col + n, :rank].t()) * float(scaling[slot])
            y[rows, col : col + n] = y[:, col : col + n].index_select(0, rows) + delta
            col += n


def lora_shrink(x: torch.Tensor, a: torch.Tensor, b_start: torch.Tensor, b_len: torch.Tensor, b_slot: torch.Tensor,
                slot_rank: torch.Tensor, max_len: int, r_sub: int | None = None) -> torch.Tensor:
    """``x @ A[slot]^T`` ``[n, R]`` for each segment with an adapter. x ``[n, K]`` (unit-stride
    rows), A ``[S, R, K]`` (R = m * r_sub: m stacked projections of r_sub rows each, of which the
    first ``slot_rank[slot]`` are the adapter's), segment i: rows ``b_start[i]`` on, ``b_len[i]``
    (at most ``max_len``) of them, adapter ``b_slot[i]`` (-1: none; its rows are left unset)."""
    r_sub = r_sub or a.shape[1]
    if use_triton(x):
        return lora_shrink_triton(x, a, b_start, b_len, b_slot, slot_rank, max_len, r_sub)
    return lora_shrink_torch(x, a, b_start, b_len, b_slot, slot_rank, max_len, r_sub)


def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, b_start: torch.Tensor,
                b_len: torch.Tensor, b_slot: torch.Tensor, slot_rank: torch.Tensor, max_len: int,
                splits: tuple[int, ...] | None = None) -> None:
    """``y += s @ B[slot]^T * scaling[slot]`` in place for each segment with an adapter, per
    projection: y ``[n, N]`` is m projections' outputs side by side (``splits``: their widths,
    summing to N; None: one projection), s ``[n, m * R]`` (projection j's shrink in columns
    ``j * R`` on), B ``[S, N, R]`` (the projections' B stacked as y's columns), scaling ``[S]``
    float32; segments as in `lora_shrink`."""
    splits = tuple(splits) if splits is not None else (y.shape[1],)
    if use_triton(y):
        lora_expand_triton(y, s, b, scaling, b_start, b_len, b_slot, slot_rank, max_len, splits)
    else:
        lora_expand_torch(y, s, b, scaling, b_start, b_len, b_slot, slot_rank, max_len, splits)
