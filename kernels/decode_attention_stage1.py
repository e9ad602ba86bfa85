"""Flash-decoding stage 1: attention of each request's single query over one split of its keys.

Each request's keys are cut into at most num_splits splits of `split_len` keys, a multiple of
BLOCK_N (`split_length` below). Program (request b, kv head, split s) takes keys
[s * split_len, min((s + 1) * split_len, seq_len)) for all query heads of that kv head's group
(K/V loaded once per group) and writes the split's normalised partial output and its
log2-sum-exp (both fp32) to scratch for stage 2.

A float8 cache (``--kv-cache-dtype fp8``) is read as it is stored and dequantized in registers:
each K/V tile is cast to q's dtype (exact: every e4m3 value is a bf16 / fp16 value), K's scale is
folded into the score scale and V's into the split's output, so no scaled copy of a tile is made.

The grid (batch, kv heads, num_splits) holds no length, so a CUDA graph replays it at any length;
num_splits is the caller's choice (`decode_attention.decode_num_splits`), a runtime argument so
that every choice shares one compiled kernel.

With ``counters`` (MERGE; `decode_attention.merge_counters`) the stage-2 merge happens here, without a launch of its own: each program
counts its split done on its (request, kv head)'s counter, and the program that finishes last
merges the written splits of its group's heads into o, as stage 2 does, then zeroes the counter
for the next call. The count's release and acquire (gpu scope) order the partials before the
merger's reads, which bypass L1 (a line of an earlier call's partials may still sit there). A
launch boundary costs a batch-1 step about 1.3-1.8 us on an H200 (benchmarks/README.md, "What a
launch costs"), once a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import LOG2E, dot_precision, launcher, next_pow2, pdl
from .triton_math import pdl_wait
from .triton_math import softcap as _softcap


@triton.jit
def split_length(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split of a request of seq_len keys: the fewest whole BLOCK_N blocks that cut it
    into at most num_splits splits. Stage 2 calls this too, to know how many splits exist."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def first_key(seq_len, window, HAS_WINDOW: tl.constexpr):
    """The first key the query (at seq_len - 1) sees: 0, or the start of its sliding window. The
    splits cut the keys [first_key, seq_len); stage 2 calls this too."""
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    return start


# num_splits unspecialised: Triton would otherwise compile other variants for 1 and for
# multiples of 16, in the middle of serving when a batch first takes that value.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_attention_stage1_kernel(
    Q, K, V, ReqToToken, BReqIdx, BSeqLen, Slopes, MidO, MidLse,
    qk_scale,  # sm_scale * log2(e) * k_scale: the softmax runs on exp2
    v_scale,   # the cache's V scale (1 unless float8)
    window,    # HAS_WINDOW: the query sees its last `window` keys
    cap,       # HAS_SOFTCAP: logit_softcap * log2(e)
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_r_req, stride_r_pos,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_mo_d,
    stride_ml_b, stride_ml_h, stride_ml_s,
    GROUP, D, num_splits,
    O, Counters, stride_o_b, stride_o_h, stride_o_d,   # MERGE only
    HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FINAL: tl.constexpr, MERGE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(BSeqLen + b)
    kv_start = first_key(seq_len, window, HAS_WINDOW)
    split_len = split_length(seq_len - kv_start, num_splits, BLOCK_N)
    split_start = kv_start + split * split_len
    if split_start >= seq_len:
        return  # stage 2 only reads the cdiv(seq_len, split_len) splits that exist
    split_end = tl.minimum(split_start + split_len, seq_len)
    req = tl.load(BReqIdx + b).to(tl.int64)

    # The group's query heads are the rows of one tile (padded to >= 16 rows for tl.dot).
    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = kv_h * GROUP + offs_g
    q_ptrs = Q + b.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if HAS_ALIBI:
        slopes = tl.load(Slopes + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    q_pos = seq_len - 1

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < split_end
        slots = tl.load(ReqToToken + req * stride_r_req + offs_n * stride_r_pos, mask=n_mask, other=0).to(tl.int64)

        k_ptrs = K + slots[None, :] * stride_k_t + kv_h * stride_k_h + offs_d[:, None] * stride_k_d
        # Operands stay in the cache's dtype: a bf16 x bf16 product is exact in the fp32 accumulator,
        # as it was upcast to tf32, and the half-width tiles made this kernel 5% faster on average over
        # batch 1-128 x 512-4096 keys (H100 sweep of 2026-11-25, benchmarks/README.md).
        k = tl.load(k_ptrs, mask=n_mask[None, :] & d_mask[:, None], other=0.0).to(q.dtype)  # [D, N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [H, N]
        if HAS_SOFTCAP:
            s = _softcap(s, cap)
        if HAS_ALIBI:
            s += slopes[:, None] * (offs_n - q_pos)[None, :].to(tl.float32)
        # The first key of a split is always valid, so m_i is finite after one block.
        s = tl.where(n_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_ptrs = V + slots[:, None] * stride_v_t + kv_h * stride_v_h + offs_d[None, :] * stride_v_d
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)  # [N, D]
        # The probabilities round to V's dtype for the product, as FlashAttention and cuDNN's
        # attention (HF's SDPA on a GPU) round them; in fp32 nothing changes.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    mo_ptrs = (MidO + b.to(tl.int64) * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s
               + offs_d[None, :] * stride_mo_d)
    tl.store(mo_ptrs, (acc / l_i[:, None] * v_scale).to(MidO.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if not FINAL:  # FINAL: one split, MidO is the output itself, and there is nothing to merge
        ml_ptrs = MidLse + b.to(tl.int64) * stride_ml_b + heads * stride_ml_h + split * stride_ml_s
        tl.store(ml_ptrs, m_i + tl.log2(l_i), mask=g_mask)
    if MERGE:
        written = tl.cdiv(seq_len - kv_start, split_len)     # the splits that exist (stage 2's count)
        counter = Counters + b * tl.num_programs(1) + kv_h
        tl.debug_barrier()                                   # every thread's partials before the count
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == written - 1:
            tl.debug_barrier()                               # every thread's reads after it
            tl.store(counter, 0)
            _merge_splits(MidO + b.to(tl.int64) * stride_mo_b, MidLse + b.to(tl.int64) * stride_ml_b,
                          O + b.to(tl.int64) * stride_o_b, heads, g_mask, offs_d, d_mask, written,
                          stride_mo_h, stride_mo_s, stride_mo_d, stride_ml_h, stride_ml_s, stride_o_h, stride_o_d,
                          BLOCK_H, BLOCK_D)


@triton.jit
def _merge_splits(mid_o, mid_lse, o, heads, g_mask, offs_d, d_mask, written, stride_mo_h, stride_mo_s, stride_mo_d,
                  stride_ml_h, stride_ml_s, stride_o_h, stride_o_d, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Stage 2's online merge (base 2) of one request's ``written`` splits for the group's heads,
    element for element the same arithmetic, so the same bits; partials read past L1."""
    mask = g_mask[:, None] & d_mask[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(0, written):
        lse = tl.load(mid_lse + heads * stride_ml_h + s * stride_ml_s, mask=g_mask, other=0.0, cache_modifier=".cg")
        part = tl.load(mid_o + heads[:, None] * stride_mo_h + s * stride_mo_s + offs_d[None, :] * stride_mo_d,
                       mask=mask, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * part
        total = total * alpha + w
        m = m_new
    o_ptrs = o + heads[:, None] * stride_o_h + offs_d[None, :] * stride_o_d
    tl.store(o_ptrs, (acc / total[:, None]).to(o.dtype.element_ty), mask=mask)


def decode_attention_stage1_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_seq_len: torch.Tensor,
    mid_o: torch.Tensor, mid_lse: torch.Tensor | None, qk_scale: float,
    alibi_slopes: torch.Tensor | None, *, block_n: int, sliding_window: int = 0, logit_softcap: float = 0.0,
    v_scale: float = 1.0, o: torch.Tensor | None = None, counters: torch.Tensor | None = None,
) -> None:
    """Fill mid_o [bs, Hq, splits, D] and mid_lse [bs, Hq, splits] (fp32, log2 domain) for each
    split (at most mid_o.shape[2] a request, each a multiple of block_n keys).

    With mid_lse None there must be one split, and mid_o is the attention's output itself
    ([bs, Hq, 1, D], any dtype): a split's normalised output rounded to it is what stage 2 would
    write from one split (weight exp2(0) = 1), so stage 2 is skipped, bit for bit the same.

    qk_scale is sm_scale * log2(e) (times K's scale for a float8 cache, whose V scale is v_scale); alibi_slopes are natural-log slopes [Hq] or None;
    sliding_window (0: none) and logit_softcap (0: none) as `decode_attention_fwd`.

    With ``o`` [bs, Hq, D] and ``counters`` (int32, at least bs x Hkv, zero; left zero) the splits
    are also merged into o, as `decode_attention_stage2_triton` would (the module's MERGE).
    """
    bs, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    num_splits = mid_o.shape[2]
    BLOCK_D = max(16, next_pow2(D))
    assert block_n >= 16 and block_n & (block_n - 1) == 0, "block_n must be a power of two >= 16"
    slopes = alibi_slopes if alibi_slopes is not None else q  # never read without HAS_ALIBI
    final = mid_lse is None
    assert not final or num_splits == 1, "only one split can be written as the output"
    lse = mid_o if final else mid_lse  # never written when final
    merge = counters is not None
    assert not merge or (not final and o is not None and counters.numel() >= bs * Hkv), "merging needs o and counters"
    out = o if merge else q            # never read or written without MERGE
    launcher(_decode_attention_stage1_kernel, q)[(bs, Hkv, num_splits)](
        q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, slopes, mid_o, lse,
        qk_scale, v_scale, sliding_window, logit_softcap * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        req_to_token.stride(0), req_to_token.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        lse.stride(0), lse.stride(1), lse.stride(2),
        group, D, num_splits,
        out, counters if merge else b_seq_len, out.stride(0), out.stride(1), out.stride(2),
        HAS_ALIBI=alibi_slopes is not None, HAS_WINDOW=sliding_window > 0, HAS_SOFTCAP=logit_softcap > 0,
        DOT_PRECISION=dot_precision(q.dtype), FINAL=final, MERGE=merge,
        BLOCK_N=block_n, BLOCK_H=max(16, next_pow2(group)), BLOCK_D=BLOCK_D,
        num_warps=4, num_stages=2,
        **pdl(q),
    )
