"""Batched LoRA: each token of a batch adds its own adapter's low-rank product to a projection's
output, ``y += (x @ A[slot]^T) @ B[slot]^T * scaling[slot]``, in one kernel per projection group
(``lora_add``): q, k and v of one ``qkv`` output (they share x) are one launch, as are gate and up.

Why one fused kernel, and what a program does. At decode an adapter's extra bytes are tiny (rank
16 on Llama-3-8B: about 0.5% of the weights), so its cost is launches and latency, not bandwidth.
A separate shrink (``s = x @ A^T``) and expand (``y += s @ B^T``) cost two launches a group and
a round trip of ``s`` through memory; here one program does both for a tile of tokens and a
chunk of output columns: it computes its tokens' ``s`` (``BLOCK_M x R``, kept in registers; the
rank is at most the pool's, 64 by default) over the whole input, then adds ``s @ B^T`` to each
``BLOCK_N`` block of its chunk. Every chunk of a projection recomputes its tokens' shrink: that
re-reads A (``R x K``, 128 KB at rank 16 and K = 4096) from L2, never from HBM twice, and costs
``R x K`` MACs a token, nothing beside the expand's reads. The host sizes the chunks so that the
programs that can have tokens fill about one wave of the SMs: at batch 1 many small chunks (the
latency is one program's shrink), with many busy segments fewer, larger ones (bounding the
re-reads).

Tokens are grouped by adapter (S-LoRA / Punica's segments): ``rows[seg_start[s] :
seg_start[s + 1]]`` are the token rows of slot ``s`` (built once a step on the host:
``llmserve.lora.pool.lora_segments``). The grid is (column chunk, slot, tile of ``BLOCK_M`` of the
slot's rows), so a program loads one adapter's A and B for up to ``BLOCK_M`` tokens at once (a
batch of 32 over 8 adapters: one program per adapter and chunk, not per request); the tiles past
a slot's rows, and so every slot without tokens and every token of the base model, exit at once.

The pool pads every adapter to its largest rank ``R`` with zeros; ``slot_rank`` masks the
padding's loads (a masked load moves no memory). A stacks a group's projections' A
(``[S, m * R, K]``), B their B as the fused output's columns (``[S, N, R]``).

Everything the kernel reads is on the device, and its grid and blocks depend on shapes only, so
a step replays from a CUDA graph with ``seg_start`` and ``rows`` graph inputs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .backend import dot_precision, launcher, next_pow2, use_triton

# Rows of a segment per program: tl.dot's least at decode (a segment holds a few tokens); wider
# tiles for segments longer than DECODE_ROWS (prompts), which re-read A less often.
BLOCK_M_DECODE, BLOCK_M_PREFILL, DECODE_ROWS = 16, 64, 256
_SHRINK_SMEM = 128 << 10    # bytes of shared memory the shrink's pipelined tiles may take


@triton.jit
def _lora_kernel(X, A, B, Y, Scaling, Rank, SegStart, Rows, Chunks, K, R_SUB,
                 stride_xm, stride_as, stride_ar, stride_bs, stride_bn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    slot = tl.program_id(1)
    seg_end = tl.load(SegStart + slot + 1)
    first = tl.load(SegStart + slot) + tl.program_id(2) * BLOCK_M
    if first >= seg_end:     # no tokens of this slot in this tile
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    rows = tl.load(Rows + offs_m, mask=m_mask, other=0).to(tl.int64)
    rank = tl.load(Rank + slot)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    # This program's columns: chunk program_id(0), of projection `proj` (its A rows start at
    # proj * R_SUB), columns col_start up to col_end of y (a chunk never spans two projections).
    chunk = Chunks + tl.program_id(0) * 3
    proj = tl.load(chunk)
    col_start = tl.load(chunk + 1)
    col_end = tl.load(chunk + 2)

    # shrink: s = x @ A^T over the whole input, for this tile's tokens
    a_ptrs = A + slot.to(tl.int64) * stride_as + (proj * R_SUB + offs_r)[None, :] * stride_ar
    x_ptrs = X + rows[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptrs + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs + offs_k[:, None], mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
    s = acc.to(B.dtype.element_ty)    # PEFT's lora_A(x) is in the activations' dtype too

    # expand: y += s @ B^T * scaling, block by block of the chunk's columns
    scaling = tl.load(Scaling + slot)
    b_ptrs = B + slot.to(tl.int64) * stride_bs + offs_r[:, None]
    for n0 in range(col_start, col_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_end
        b = tl.load(b_ptrs + offs_n[None, :] * stride_bn, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        delta = tl.dot(s, b, input_precision=DOT_PRECISION) * scaling
        y_ptrs = Y + rows[:, None] * stride_ym + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(Y.dtype.element_ty), mask=mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Programs in one wave (the interpreter's CPU gets a few, so its tests loop over chunks)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_CHUNK_TABLES: dict[tuple, torch.Tensor] = {}


def _chunk_table(splits: tuple[int, ...], block_n: int, blocks_per_chunk: int, device: torch.device) -> torch.Tensor:
    """(projection, first column, end column) of each chunk of ``blocks_per_chunk`` column blocks
    of an output made of projections of ``splits`` columns: made once per shape and device, so a
    step replayed from a CUDA graph reads a tensor that lives as long as the process (the first,
    uncaptured run makes it)."""
    key = (splits, block_n, blocks_per_chunk, str(device))
    if key not in _CHUNK_TABLES:
        rows, start, width = [], 0, block_n * blocks_per_chunk
        for j, n in enumerate(splits):
            rows += [(j, c, min(c + width, start + n)) for c in range(start, start + n, width)]
            start += n
        _CHUNK_TABLES[key] = torch.tensor(rows, dtype=torch.int32).to(device)
    return _CHUNK_TABLES[key]


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                    slot_rank: torch.Tensor, seg_start: torch.Tensor, rows: torch.Tensor, max_len: int,
                    splits: tuple[int, ...], r_sub: int) -> None:
    """Triton version of `lora_add`."""
    n, k = x.shape
    num_slots = seg_start.numel() - 1
    if n == 0 or num_slots == 0 or max_len == 0:
        return
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1
    block_m = BLOCK_M_DECODE if max_len <= DECODE_ROWS else BLOCK_M_PREFILL
    block_r = max(16, next_pow2(r_sub))
    # The shrink's loads are what a program waits on (its latency is about one SM's share of
    # bandwidth: A's R x K bytes over the bytes in flight), so it pipelines wide tiles over 3 or 4
    # stages within 128 KiB of shared memory (a stage: x's and A's tiles, (BLOCK_M + BLOCK_R) x BLOCK_K).
    stage_rows = (block_m + block_r) * x.element_size()
    block_k = max(16, min(512, next_pow2(k), next_pow2(_SHRINK_SMEM // (3 * stage_rows) + 1) // 2))
    num_stages = max(2, min(4, _SHRINK_SMEM // (stage_rows * block_k)))
    block_n = min(128, max(16, next_pow2(min(splits))))
    # Tiles that can hold tokens: the rows' tiles, plus one per segment boundary.
    busy = min(num_slots, n) + triton.cdiv(n, block_m) - 1
    blocks = sum(triton.cdiv(c, block_n) for c in splits)
    chunks = _chunk_table(tuple(splits), block_n, triton.cdiv(blocks * busy, _num_sms(y.device)), y.device)
    grid = (chunks.shape[0], num_slots, triton.cdiv(max_len, block_m))
    launcher(_lora_kernel, y)[grid](
        x, a, b, y, scaling, slot_rank, seg_start, rows, chunks, k, r_sub,
        x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, DOT_PRECISION=dot_precision(y.dtype),
        num_stages=num_stages,
    )


def lora_add_torch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                   slot_rank: torch.Tensor, seg_start: torch.Tensor, rows: torch.Tensor, max_len: int,
                   splits: tuple[int, ...], r_sub: int) -> None:
    """Torch twin of `lora_add`, computed as PEFT's ``result + lora_B(lora_A(x)) * scaling``, each
    projection on its own, at the adapter's own rank."""
    starts = seg_start.tolist()
    for slot in range(len(starts) - 1):
        if starts[slot] == starts[slot + 1]:
            continue
        idx = rows[starts[slot] : starts[slot + 1]].long()
        rank, scale = int(slot_rank[slot]), float(scaling[slot])
        xs = x.index_select(0, idx)
        col = 0
        for j, width in enumerate(splits):
            s = xs @ a[slot, j * r_sub : j * r_sub + rank].t()
            delta = (s @ b[slot, col : col + width, :rank].t()) * scale
            y[idx, col : col + width] = y[:, col : col + width].index_select(0, idx) + delta
            col += width


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
