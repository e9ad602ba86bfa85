"""Mixture-of-experts MLP: each token's output is the routing-weighted sum, over its top-k
experts, of that expert's SwiGLU MLP, ``down_e(silu(gate_e(x)) * up_e(x))``.

The Triton path runs three launches (two for one token) and a sum: ``_moe_align_kernel`` sorts the n * k
(token, expert) pairs by expert into blocks of ``BLOCK_M`` rows, each block one expert's (the
last block of an expert padded with a sentinel); ``_fused_moe_kernel`` then runs as a grouped
GEMM, one program per (block, column tile), reading its block's expert's weights once: first
for gate_up with SiLU-and-mul fused (``[n*k, I]``), then for down with the routing weight
applied (``[n*k, H]``). The k rows of a token are summed last. Buffer sizes depend on n, k and
the number of experts only (the worst-case padding), never on the routing, so a decode step is
captured in a CUDA graph as is; a block past the routing's real end returns at once.

At batch 64 of Qwen3-30B-A3B (128 experts, top 8) most experts are hit by a few tokens each,
and every touched expert's weights are read once.

Up to ``GEMV_MAX_TOKENS`` tokens (decode steps of a small batch) the pairs are too few for tiles
of tensor-core rows: a 16-row block holding one real row reads the expert's weights at a
fraction of the bandwidth, and 8 pairs make too few programs to busy the GPU. There the two
projections run as GEMVs (`gemv`'s shape: a program owns a few output features of one weight and
walks all of K in wide chunks), two launches and nothing else: `gemv_act_and_mul`'s kernel, one
program per (pair, block of I), reads the pair's expert's gate and up rows and writes SiLU-and-mul;
``_moe_down_gemv_kernel``, one program per (token, block of H), reads the down rows of all k of
the token's experts at once, applies the routing weights and sums over the k in registers (no
``[n*k, H]`` buffer, no separate sum). Both GEMV kernels sum each chunk's products a 16-byte
vector at a time in registers and across lanes once at the end (see `gemv`), which halves their
registers and so doubles the programs, and the bytes in flight, an SM holds. A pair's expert is
read by its own programs, so two tokens routed to one expert read it twice (from L2 when the
programs run together); at a few tokens that costs less than the sorting and the mostly-empty
blocks.

Rounded as HF's ``MixtralExperts``: gate, up, the SiLU output and their product round to the
activation dtype; the routing weights (float32, from ``moe_route``) multiply the down
projection's output rounded to that dtype. (Qwen-MoE's router rounds its weights to the
activation dtype first; in half precision that is within its tolerance, in float32 the same.)
The Triton paths sum a token's k outputs in float32 and round once; HF adds them one expert at
a time in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import dot_precision, launcher, next_pow2, pdl, use_triton, vector_width
from .gemv import ACT_AND_MUL_TILES, gemv_act_and_mul_triton, gemv_block_k
from .triton_math import pdl_wait, silu


@triton.jit
def _moe_align_kernel(TopkIds, SortedPairs, BlockExpert, NumPadded, P, num_blocks,
                      BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    # One program. Pairs are numbered p = token * k + slot (topk_ids flattened); pair p of
    # expert e goes to row pad_start[e] + (its rank among e's pairs), each expert's rows rounded
    # up to whole blocks. Rows left over hold P (no pair).
    pdl_wait(PDL)
    experts = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], tl.int32)
    for c0 in range(0, P, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(TopkIds + offs, mask=offs < P, other=E_P2)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    tl.store(NumPadded, tl.sum(padded, axis=0))
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        # the block's expert: how many experts end at or before the block's first row
        owner = tl.sum((pad_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(BlockExpert + blocks, owner, mask=blocks < num_blocks)
    for s0 in range(0, num_blocks * BLOCK_M, CHUNK):
        rows = s0 + tl.arange(0, CHUNK)
        tl.store(SortedPairs + rows, tl.zeros([CHUNK], tl.int32) + P, mask=rows < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the sentinel fill above lands before the scatter below overwrites it
    seen = tl.zeros([E_P2], tl.int32)
    for c0 in range(0, P, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(TopkIds + offs, mask=offs < P, other=E_P2)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - 1 + seen[None, :]  # rank of each pair among its expert's
        dest = tl.sum(onehot * (pad_start[None, :] + rank), axis=1)
        tl.store(SortedPairs + dest, offs, mask=offs < P)
        seen += tl.sum(onehot, axis=0)


@triton.jit
def _fused_moe_kernel(A, W, C, TopkWeights, SortedPairs, BlockExpert, NumPadded,
                      N, K, P, A_ROWS_PER_PAIR_DIV,
                      stride_am, stride_we, stride_wn, stride_cm,
                      SILU_MUL: tl.constexpr, MUL_ROUTING_WEIGHT: tl.constexpr, SORTED: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # C[pair, n] = A[pair // DIV] . W[expert, n] for the pairs of block program_id(0). With
    # SILU_MUL, W holds [gate; up] (2N rows) and C = silu(A W_gate^T) * (A W_up^T). Unless
    # SORTED, block i is pair i alone and BlockExpert is topk_ids (one token: no align launch).
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    if SORTED:
        if pid_m * BLOCK_M >= tl.load(NumPadded):
            return
        pairs = tl.load(SortedPairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    else:
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, P)
    valid = pairs < P
    a_rows = (pairs // A_ROWS_PER_PAIR_DIV).to(tl.int64)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = W + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(A + a_rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if SILU_MUL:
            w_up = tl.load(w_base + (N + offs_n)[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    if SILU_MUL:
        # as HF: gate and up round to the dtype, silu's output rounds, then the product
        gate = acc.to(C.dtype.element_ty).to(tl.float32)
        up = acc_up.to(C.dtype.element_ty).to(tl.float32)
        acc = silu(gate).to(C.dtype.element_ty).to(tl.float32) * up
    if MUL_ROUTING_WEIGHT:
        acc = acc.to(C.dtype.element_ty).to(tl.float32) * tl.load(TopkWeights + pairs, mask=valid, other=0.0)[:, None]
    out = C + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_gemv_kernel(Act, W2, Out, TopkWeights, TopkIds, H, I, stride_we, stride_wn, stride_om,
                          TOP_K: tl.constexpr, K_P2: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr):
    # Out[t, n] = sum over slots s of weight[t, s] * (Act[t * TOP_K + s] . W2[e_s, n]) for the
    # token program_id(0) and BLOCK_N features n: the k experts' tiles are one [K_P2, BLOCK_N,
    # BLOCK_K] load, so a program has k times a GEMV's bytes in flight. Each chunk's products are
    # summed VEC at a time (a thread's own 16-byte vector) into a [K_P2, BLOCK_N, BLOCK_K / VEC]
    # accumulator, an eighth of a full tile's in half precision. With Triton 3.6 (the GPU
    # machine's) at Qwen3-30B-A3B's default tiles, sm_90: 80 registers a thread against 140 with
    # the full tile, so 6 programs an SM instead of 3: all 512 of a token's programs are resident
    # at once (8 MB in flight), where 3 an SM left a second, mostly empty wave. (Triton 3.7 lays
    # the tile out with the warps along the features instead: 128 registers, 4 programs an SM,
    # and the activations pass between warps through shared memory each chunk; the [BLOCK_N,
    # K_P2, BLOCK_K] order swaps the two versions' outcomes.)
    pdl_wait(PDL)
    token = tl.program_id(0)
    slots = tl.arange(0, K_P2)
    slot_mask = slots < TOP_K
    pairs = token * TOP_K + slots
    experts = tl.load(TopkIds + pairs, mask=slot_mask, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = (W2 + experts[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :])
    a_ptrs = Act + pairs.to(tl.int64)[:, None] * I + offs_k[None, :]
    if EVEN_N:
        w_mask = slot_mask[:, None, None]
    else:
        w_mask = slot_mask[:, None, None] & n_mask[None, :, None]
    acc = tl.zeros([K_P2, BLOCK_N, BLOCK_K // VEC], tl.float32)
    # Each chunk's loads go out before the previous chunk's sums (the chunk past I: all masked
    # off, no traffic). Without this, Triton 3.6's schedule splits a chunk's loads into two or
    # three waits on memory; with it, one burst a chunk.
    if EVEN_K:
        a = tl.load(a_ptrs, mask=slot_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    else:
        a = tl.load(a_ptrs, mask=slot_mask[:, None] & (offs_k < I)[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=w_mask & (offs_k < I)[None, None, :], other=0.0)
    for k0 in range(BLOCK_K, I + BLOCK_K, BLOCK_K):
        if EVEN_K:
            more = k0 < I
            a_next = tl.load(a_ptrs + k0, mask=slot_mask[:, None] & more, other=0.0)
            w_next = tl.load(w_ptrs + k0, mask=w_mask & more, other=0.0)
        else:
            k_mask = (k0 + offs_k) < I
            a_next = tl.load(a_ptrs + k0, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
            w_next = tl.load(w_ptrs + k0, mask=w_mask & k_mask[None, None, :], other=0.0)
        prod = w.to(tl.float32) * a.to(tl.float32)[:, None, :]
        acc += tl.sum(tl.reshape(prod, [K_P2, BLOCK_N, BLOCK_K // VEC, VEC]), 3)
        a = a_next
        w = w_next
    # as HF: each expert's output rounds to the dtype, and again once its routing weight multiplies it
    h = tl.sum(acc, 2).to(Out.dtype.element_ty).to(tl.float32)
    h = (h * tl.load(TopkWeights + pairs, mask=slot_mask, other=0.0)[:, None]).to(Out.dtype.element_ty)
    out = tl.sum(h.to(tl.float32), 0)
    tl.store(Out + token.to(tl.int64) * stride_om + offs_n, out.to(Out.dtype.element_ty), mask=n_mask)


def _block_config(pairs: int, num_experts: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes by the expected rows per expert: a decode step's few rows per expert want the
    smallest block tl.dot takes; a prefill's many want tiles that reuse each weight tile.
    float32 halves BLOCK_K, so that the pipelined tiles (A and gate's and up's weight tiles,
    three stages) stay within an H100's shared memory."""
    rows_per_expert = pairs / num_experts
    if rows_per_expert <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4)
    elif rows_per_expert <= 64:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8)
    if dtype == torch.float32:
        cfg["BLOCK_K"] //= 2
    return cfg


# Above this many pairs (a prefill), the one-program align kernel's serial loops cost more than
# torch's parallel sort (about ten launches); at or below it (decode steps up to batch 256 at top 8)
# the kernel's single launch is cheaper.
ALIGN_KERNEL_MAX_PAIRS = 4096


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs sorted into per-expert blocks of ``block_m`` rows:
    ``sorted_pairs`` (pair ids, ``n * k`` where a row is padding), ``block_expert`` (each block's
    expert) and ``num_padded`` (``[1]``: rows in use). Sizes are the worst case for n, k and the
    number of experts, so nothing here waits on the routing."""
    P = topk_ids.numel()
    num_blocks = triton.cdiv(P + min(num_experts, P) * (block_m - 1), block_m)
    if P > ALIGN_KERNEL_MAX_PAIRS:
        return moe_align_sorting(topk_ids, num_experts, block_m, num_blocks)
    dev = topk_ids.device
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1).to(torch.int32)
    launcher(_moe_align_kernel, ids)[(1,)](ids, sorted_pairs, block_expert, num_padded, P, num_blocks,
                                           BLOCK_M=block_m, E_P2=next_pow2(num_experts), CHUNK=64, num_warps=4,
                                           **pdl(ids))
    return sorted_pairs, block_expert, num_padded


def moe_align_sorting(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                      num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align` by torch's stable sort, the same rows in use (no host sync either)."""
    ids = topk_ids.reshape(-1).long()
    P, dev = ids.numel(), ids.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.sort(ids, stable=True).indices                     # pairs by expert, in pair order
    expert = ids[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[expert]
    sorted_pairs = torch.full((num_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs[(pad_end - padded)[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert, pad_end[-1:].to(torch.int32)


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor,
                  align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], sorted_: bool, a_div: int, n: int,
                  silu_mul: bool, cfg: dict[str, int]) -> None:
    sorted_pairs, block_expert, num_padded = align
    grid = (block_expert.shape[0], triton.cdiv(n, cfg["BLOCK_N"]))
    launcher(_fused_moe_kernel, a)[grid](
        a, w, out, topk_weights, sorted_pairs, block_expert, num_padded,
        n, w.shape[2], out.shape[0], a_div, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        SILU_MUL=silu_mul, MUL_ROUTING_WEIGHT=not silu_mul, SORTED=sorted_,
        DOT_PRECISION=dot_precision(a.dtype), **cfg,
        **pdl(a),
    )


# Up to this many tokens `fused_moe_triton` runs the two GEMV kernels, from the next the sorted
# grouped GEMM (`benchmarks/fused_moe.py` times both paths at each batch size up to 16).
GEMV_MAX_TOKENS = 8

# (BLOCK_N, largest BLOCK_K, num_warps) of the GEMV kernels, as `gemv.TILES`: gate_up is
# `gemv_act_and_mul`'s kernel (two weight tiles a chunk, gate's and up's rows); down loads a tile
# per slot, k of them, and its largest BLOCK_K keeps k * BLOCK_N * BLOCK_K at DOWN_TILE_ELEMENTS
# (top 8: 256; top 2: 1024), the bytes in flight of gate_up's two tiles.
GATE_UP_TILES = ACT_AND_MUL_TILES
DOWN_TILE_ELEMENTS = 8192


def down_tiles_for(top_k: int) -> tuple[int, int, int]:
    """The GEMV path's default down tiles for ``top_k`` slots."""
    return 4, max(64, DOWN_TILE_ELEMENTS // (4 * max(2, next_pow2(top_k)))), 4


def fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, gate_up_tiles: tuple[int, int, int] = GATE_UP_TILES,
                   down_tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """`fused_moe_triton` as two GEMV launches, for a few tokens (see the module's docstring);
    the tiles are (BLOCK_N, largest BLOCK_K, num_warps), for the benchmark's sweep (down's
    default: `down_tiles_for`)."""
    n, k = topk_ids.shape
    H, I = x.shape[1], w2.shape[2]
    assert w2.stride(2) == 1, "each expert's rows must be unit-stride"
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    act = gemv_act_and_mul_triton(x, w13, "silu", expert_ids=ids, rows_per_x=k, tiles=gate_up_tiles)
    out = torch.empty_like(x)
    block_n, largest_k, num_warps = down_tiles or down_tiles_for(k)
    block_k = gemv_block_k(I, largest_k)
    launcher(_moe_down_gemv_kernel, x)[(n, triton.cdiv(H, block_n))](
        act, w2, out, weights, ids, H, I, w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=k, K_P2=max(2, next_pow2(k)), EVEN_N=H % block_n == 0, EVEN_K=I % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k,
        VEC=vector_width(x, block_k), num_warps=num_warps, num_stages=1,
        **pdl(x),
    )
    return out


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """Triton version of `fused_moe`: GEMVs for a few tokens, the grouped GEMM for more."""
    x = x.contiguous()
    n = topk_ids.shape[0]
    if n == 0:
        return torch.zeros_like(x)
    if n <= GEMV_MAX_TOKENS:
        return fused_moe_gemv(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_grouped(x, w13, w2, topk_weights, topk_ids)


def fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe_triton` as a grouped GEMM over the pairs sorted by expert (x contiguous, one
    token or more)."""
    n, k = topk_ids.shape
    E, I = w13.shape[0], w2.shape[2]
    cfg = _block_config(n * k, E, x.dtype)
    # One token's k experts are distinct: each its own block, in topk_ids' order, needs no sorting.
    sorted_ = n > 1
    if sorted_:
        align = moe_align(topk_ids, E, cfg["BLOCK_M"])
    else:
        ids = topk_ids.reshape(-1)
        align = (ids, ids, ids)  # block i is pair i, its expert ids[i]; the other two go unread
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty((n * k, I), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, weights, align, sorted_, k, I, True, cfg)
    out = torch.empty((n * k, x.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, out, weights, align, sorted_, 1, x.shape[1], False, cfg)
    return out.view(n, k, -1).sum(1)


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """Torch twin of `fused_moe`, op for op as HF's experts loop (one expert at a time, its
    tokens gathered, the weighted outputs added back in the activation dtype)."""
    out = torch.zeros_like(x)
    I = w2.shape[2]
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)
        gate_up = F.linear(x[token], w13[e])
        h = F.linear(F.silu(gate_up[:, :I]) * gate_up[:, I:], w2[e])
        out.index_add_(0, token, (h * topk_weights[token, slot, None]).to(x.dtype))
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum for x ``[n, H]``: ``w13`` ``[E, 2I, H]`` (each expert's gate
    rows then its up rows), ``w2`` ``[E, H, I]``, ``topk_weights`` ``[n, k]`` (float32) and
    ``topk_ids`` ``[n, k]`` from `select_experts`. Returns a new ``[n, H]`` tensor in x's dtype
    (under tensor parallelism, this rank's partial sum over its slice of I)."""
    if use_triton(x):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_torch(x, w13, w2, topk_weights, topk_ids)
