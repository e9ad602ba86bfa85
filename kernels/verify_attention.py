"""Attention of a few new tokens a request over its paged KV cache, split-K (speculative verify).

The operation is `context_attention_fwd`'s (query j of request i is row b_q_start[i] + j, at
position b_cached_len[i] + j, attending causally to its request's keys), for batches in which
every request brings at most VERIFY_MAX_Q_LEN new tokens: a verify step's 1 + K tokens, or a
decode step's one beside a short draft. The context kernel gives each (head, query block) one
program that walks the whole context, so at batch 1 a verify step's attention ran on a few dozen
programs over 1024 keys and cost about 1 ms more a step than the decode kernel's split-K
(issue 35). Here a request's keys are cut into splits as decode_attention does it:

  * Stage 1, program (request, kv head, split): every query row of the request for every query
    head of the kv head's group, as the rows of one tile ((query, head-in-group) pairs, as the
    context kernel's PACK_GQA), over the split's keys, with the causal mask (and the sliding
    window) per row. K/V are loaded once per group and split, as in decode stage 1 (a request
    with more than VERIFY_BLOCK_M rows takes several programs, a row block each).
  * Stage 2: decode_attention_stage2's merge, per query row, over every split (b_seq_len None).

The keys cut are [first, cached + q_len): first is 0, or with a sliding window the first key the
request's first query sees. A split may hold no key a row sees (the last split, past an early
row's position; a split past the keys): the row writes a zero partial of log-sum-exp -inf, which
the merge weighs 0. Split 0 always holds a key every row sees (its first key, or with a window
the row's own first, within the first q_len <= BLOCK_N keys), so the merge starts finite.

The grid (batch, kv heads, num_splits) holds no length, so the verify step's CUDA graph replays
it at any context; num_splits follows the batch's rows (`verify_num_splits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import LOG2E, dot_precision, launcher, next_pow2, pdl, softmax_scale, use_triton
from .context_attention import context_attention_fwd_torch
from .decode_attention import DECODE_BLOCK_N, decode_num_splits
from .decode_attention_stage1 import split_length
from .decode_attention_stage2 import decode_attention_stage2_triton
from .triton_math import pdl_wait
from .triton_math import softcap as _softcap

# The most new tokens a request may bring for a batch to take this path: a verify step's 1 + K
# up to --speculate 15 (a longer draft takes the context kernel). Stage 1 holds a request's
# rows times its group's heads in one tile, and split 0 must hold a key every row sees, which
# needs q_len <= BLOCK_N (see the module docstring).
VERIFY_MAX_Q_LEN = 16
# The most rows (query, head-in-group pairs) a stage-1 program holds: its fp32 accumulator is
# BLOCK_M x head_dim on 4 warps (64 x 128: 64 registers a thread); a request with more rows
# takes several row blocks, each reading the split's K/V (the later ones mostly from L2).
VERIFY_BLOCK_M = 64


def verify_num_splits(batch_size: int, total_q: int, max_q_len: int, kv_heads: int) -> int:
    """How many splits a request's keys may be cut into: decode's choice (`decode_num_splits`)
    for as many requests as the batch's rows make at max_q_len a request.

    Not the batch size itself: a verify step replayed from its CUDA graph is padded to the graph's
    largest batch (32 requests by default) with requests that bring no token, and decode's choice
    for 32 requests (2 splits of a 1024-token context) would leave a step of one request on 16
    programs. Its rows are padded only to a bucket (8 for 1 + 4 tokens), so the estimate stays
    near the requests that bring tokens in the graph as in the eager step; requests of one token
    beside a draft make it low, which costs more splits than needed, not a serial walk."""
    return decode_num_splits(max(1, min(batch_size, triton.cdiv(total_q, max_q_len))), kv_heads)


@triton.jit(do_not_specialize=["num_splits"])  # as decode stage 1's
def _verify_attention_stage1_kernel(
    Q, K, V, ReqToToken, BReqIdx, BQStart, BQLen, BCachedLen, Slopes, MidO, MidLse,
    qk_scale,  # sm_scale * log2(e) * k_scale: the softmax runs on exp2
    v_scale,   # the cache's V scale (1 unless float8)
    window,    # HAS_WINDOW: the query at p sees keys (p - window, p]
    cap,       # HAS_SOFTCAP: logit_softcap * log2(e)
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_r_req, stride_r_pos,
    stride_mo_t, stride_mo_h, stride_mo_s, stride_mo_d,
    stride_ml_t, stride_ml_h, stride_ml_s,
    GROUP, D, num_splits, row_blocks,
    HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    kv_h = tl.program_id(1) // row_blocks
    row_block = tl.program_id(1) % row_blocks
    split = tl.program_id(2)

    q_len = tl.load(BQLen + b)
    if row_block * BLOCK_M >= q_len * GROUP:
        return  # a row block past this request's rows
    cached = tl.load(BCachedLen + b)
    end = cached + q_len
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(cached - window + 1, 0)  # the first query's first key
    split_len = split_length(end - kv_start, num_splits, BLOCK_N)
    split_start = kv_start + split * split_len
    split_end = tl.minimum(split_start + split_len, end)  # <= split_start past the keys: no loop
    req = tl.load(BReqIdx + b).to(tl.int64)
    q_start = tl.load(BQStart + b).to(tl.int64)

    # Row r of the request's rows: query r // GROUP, query head kv_h * GROUP + r % GROUP.
    offs_r = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = offs_r // GROUP
    heads = kv_h * GROUP + offs_r % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = offs_j < q_len
    d_mask = offs_d < D
    rows = q_start + offs_j.to(tl.int64)
    q_ptrs = Q + rows[:, None] * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d
    q = tl.load(q_ptrs, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    pos_m = cached + offs_j
    if HAS_ALIBI:
        slopes = tl.load(Slopes + heads, mask=r_mask, other=0.0).to(tl.float32) * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < split_end
        slots = tl.load(ReqToToken + req * stride_r_req + offs_n * stride_r_pos, mask=n_mask, other=0).to(tl.int64)

        # K as [D, N] and both operands in the cache's dtype (cast to q's: exact for float8), as
        # decode stage 1 reads them.
        k_ptrs = K + slots[None, :] * stride_k_t + kv_h * stride_k_h + offs_d[:, None] * stride_k_d
        k = tl.load(k_ptrs, mask=n_mask[None, :] & d_mask[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        if HAS_SOFTCAP:
            s = _softcap(s, cap)
        if HAS_ALIBI:
            s += slopes[:, None] * (offs_n[None, :] - pos_m[:, None]).to(tl.float32)
        visible = n_mask[None, :] & (offs_n[None, :] <= pos_m[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos_m[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may have seen no key yet (the causal diagonal or its window lies further on):
        # subtract 0 instead of its -inf max, so its probabilities are 0, not NaN (-inf - -inf).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_ptrs = V + slots[:, None] * stride_v_t + kv_h * stride_v_h + offs_d[None, :] * stride_v_d
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)  # [N, D]
        # P rounds to V's dtype for the product, as decode stage 1 (and FlashAttention) do.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A row that saw no key of this split: a zero partial, weighed exp2(-inf) = 0 by the merge.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None] * v_scale
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    mo_ptrs = (MidO + rows[:, None] * stride_mo_t + heads[:, None] * stride_mo_h + split * stride_mo_s
               + offs_d[None, :] * stride_mo_d)
    tl.store(mo_ptrs, out, mask=r_mask[:, None] & d_mask[None, :])
    tl.store(MidLse + rows * stride_ml_t + heads * stride_ml_h + split * stride_ml_s, lse, mask=r_mask)


def verify_attention_fwd_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_q_start: torch.Tensor,
    b_q_len: torch.Tensor, b_cached_len: torch.Tensor, max_q_len: int,
    alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
    sliding_window: int = 0, logit_softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
    *, num_splits: int | None = None, block_n: int = DECODE_BLOCK_N,
) -> None:
    """Triton version of `verify_attention_fwd`: at most `num_splits` splits a request (default:
    `verify_num_splits`), of a multiple of `block_n` keys each."""
    bs = b_req_idx.shape[0]
    total_q, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if bs == 0 or total_q == 0 or max_q_len <= 0:
        return
    if max_q_len > min(VERIFY_MAX_Q_LEN, block_n):
        raise ValueError(f"verify attention takes at most {min(VERIFY_MAX_Q_LEN, block_n)} new tokens a request, "
                         f"got {max_q_len}")
    group = Hq // Hkv
    num_splits = num_splits or verify_num_splits(bs, total_q, max_q_len, Hkv)
    # A request's rows (queries x the group's heads) in row blocks of at most VERIFY_BLOCK_M:
    # one block up to 1 + 15 tokens of a group of 4 (Llama-3-8B's); more with larger groups.
    block_m = max(16, min(VERIFY_BLOCK_M, next_pow2(max_q_len * group)))
    row_blocks = triton.cdiv(max_q_len * group, block_m)
    # Scratch is fp32 whatever the model dtype: partials are merged before rounding.
    mid_o = torch.empty((total_q, Hq, num_splits, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((total_q, Hq, num_splits), dtype=torch.float32, device=q.device)
    slopes = alibi_slopes if alibi_slopes is not None else q  # never read without HAS_ALIBI
    # Requests that bring tokens come first, and there are at most total_q of them: a verify
    # graph's padding requests (no tokens, up to its largest batch) past that get no programs.
    launcher(_verify_attention_stage1_kernel, q)[(min(bs, total_q), Hkv * row_blocks, num_splits)](
        q, k_cache, v_cache, req_to_token, b_req_idx, b_q_start, b_q_len, b_cached_len, slopes, mid_o, mid_lse,
        softmax_scale(sm_scale, D) * LOG2E * k_scale, v_scale, sliding_window, logit_softcap * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        req_to_token.stride(0), req_to_token.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        group, D, num_splits, row_blocks,
        HAS_ALIBI=alibi_slopes is not None, HAS_WINDOW=sliding_window > 0, HAS_SOFTCAP=logit_softcap > 0,
        DOT_PRECISION=dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)),
        num_warps=4, num_stages=2,
        **pdl(q),
    )
    decode_attention_stage2_triton(mid_o, mid_lse, o, None, block_n=block_n)


# The twin is the context twin: the same operation, which on a CPU has no programs to split over.
verify_attention_fwd_torch = context_attention_fwd_torch


def verify_attention_fwd(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_q_start: torch.Tensor,
    b_q_len: torch.Tensor, b_cached_len: torch.Tensor, max_q_len: int,
    alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
    sliding_window: int = 0, logit_softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """`context_attention_fwd` (the same arguments and output) for a batch in which every request
    brings at most VERIFY_MAX_Q_LEN new tokens (max_q_len <= VERIFY_MAX_Q_LEN), and requests that
    bring none (a CUDA graph's padding) come after those that do."""
    args = (q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, b_q_len, b_cached_len,
            max_q_len, alibi_slopes, sm_scale, sliding_window, logit_softcap, k_scale, v_scale)
    if use_triton(q):
        verify_attention_fwd_triton(*args)
    else:
        verify_attention_fwd_torch(*args)
