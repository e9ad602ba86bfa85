"""Causal attention of new query tokens over a request's paged KV cache.

Serves prefill (cached 0), chunked prefill / prefix-cache hits and speculative
verification (cached > 0, several new tokens). Query j of request i is row
b_q_start[i] + j of q/o, sits at position p = b_cached_len[i] + j, and attends to key
positions 0..p, whose KV-pool slots are req_to_token[b_req_idx[i], pos].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import LOG2E, dot_precision, launcher, next_pow2, sdpa_attention, softmax_scale, use_triton


@triton.jit
def _context_attention_kernel(
    Q, K, V, O, ReqToToken, BReqIdx, BQStart, BQLen, BCachedLen, Slopes,
    qk_scale,  # sm_scale * log2(e): the softmax runs on exp2
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_r_req, stride_r_pos,
    GROUP, D,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, HALF_MMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    start_m = tl.program_id(2)

    q_len = tl.load(BQLen + b)
    if start_m * BLOCK_M >= q_len:
        return
    cached = tl.load(BCachedLen + b)
    q_start = tl.load(BQStart + b).to(tl.int64)
    req = tl.load(BReqIdx + b).to(tl.int64)
    kv_h = h // GROUP

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < D
    pos_m = cached + offs_m

    q_ptrs = Q + (q_start + offs_m)[:, None] * stride_q_t + h * stride_q_h + offs_d[None, :] * stride_q_d
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    if HALF_MMA:
        # Compiled fp16/bf16: the two matmuls take half-precision operands (as FlashAttention
        # does) with fp32 accumulation, ~2.5x the tf32 rate; softmax statistics stay fp32.
        q = q.to(K.dtype.element_ty)

    if HAS_ALIBI:
        slope = tl.load(Slopes + h).to(tl.float32) * 1.4426950408889634  # into the log2 domain

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys up to the last query of this block. Every row, masked ones included, sees
    # key 0 in the first block, so m_i is finite after it and no row makes NaNs.
    end = cached + tl.minimum((start_m + 1) * BLOCK_M, q_len)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(ReqToToken + req * stride_r_req + offs_n * stride_r_pos, mask=n_mask, other=0).to(tl.int64)

        k_ptrs = K + slots[None, :] * stride_k_t + kv_h * stride_k_h + offs_d[:, None] * stride_k_d
        k = tl.load(k_ptrs, mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # [D, N]
        if HALF_MMA:
            s = tl.dot(q, k) * qk_scale
        else:
            s = tl.dot(q, k.to(tl.float32), input_precision=DOT_PRECISION) * qk_scale
        if HAS_ALIBI:
            s += slope * (offs_n[None, :] - pos_m[:, None]).to(tl.float32)
        causal = (offs_n[None, :] <= pos_m[:, None]) & n_mask[None, :]
        s = tl.where(causal, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_ptrs = V + slots[:, None] * stride_v_t + kv_h * stride_v_h + offs_d[None, :] * stride_v_d
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [N, D]
        if HALF_MMA:
            acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = O + (q_start + offs_m)[:, None] * stride_o_t + h * stride_o_h + offs_d[None, :] * stride_o_d
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _default_tiles(max_q_len: int, programs_per_m_row: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the winners of
    benchmarks/tune_context_attention.py on an H100 (bf16, D=128, Triton 3.6), 2026-11-21.

    Few new tokens per request (speculative verification) want 16-row query blocks, which waste
    no tensor-core rows; longer chunks and prefills want 64 rows, or 128 once there are enough
    (request, head, block) programs to fill the GPU several times over."""
    if max_q_len <= 16:
        return 16, 64, 4, 2
    if max_q_len <= 128 or programs_per_m_row * triton.cdiv(max_q_len, 128) < 1024:
        return 64, 64, 4, 3
    return 128, 64, 4, 3


def context_attention_fwd_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_q_start: torch.Tensor,
    b_q_len: torch.Tensor, b_cached_len: torch.Tensor, max_q_len: int,
    alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
    *, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> None:
    """Triton version of `context_attention_fwd`; tiles may be forced (tests, tuning sweeps)."""
    bs = b_req_idx.shape[0]
    _, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if bs == 0 or max_q_len <= 0:
        return
    BLOCK_D = max(16, next_pow2(D))
    d_bm, d_bn, d_warps, d_stages = _default_tiles(max_q_len, bs * Hq)
    BLOCK_M, BLOCK_N = block_m or d_bm, block_n or d_bn
    num_warps, num_stages = num_warps or d_warps, num_stages or d_stages
    slopes = alibi_slopes if alibi_slopes is not None else q  # never read without HAS_ALIBI
    grid = (bs, Hq, triton.cdiv(max_q_len, BLOCK_M))
    launcher(_context_attention_kernel, q)[grid](
        q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, b_q_len, b_cached_len, slopes,
        softmax_scale(sm_scale, D) * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        req_to_token.stride(0), req_to_token.stride(1),
        Hq // Hkv, D,
        HAS_ALIBI=alibi_slopes is not None, DOT_PRECISION=dot_precision(q.dtype),
        HALF_MMA=q.is_cuda and q.dtype in (torch.float16, torch.bfloat16),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        num_warps=num_warps, num_stages=num_stages,
    )


def context_attention_fwd_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_q_start: torch.Tensor,
    b_q_len: torch.Tensor, b_cached_len: torch.Tensor, max_q_len: int,
    alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
) -> None:
    """Torch twin of `context_attention_fwd`: a batch of several fp32 requests in one SDPA call
    (`_batched_sdpa_context`); one request, or half precision, per request: gather K/V and attend
    through SDPA as HF does (`sdpa_attention`); with ALiBi biases, per request with an fp32 softmax."""
    sm_scale = softmax_scale(sm_scale, q.shape[-1])
    q_lens, cached_lens = b_q_len.tolist(), b_cached_len.tolist()
    # One SDPA call for the batch rather than gathers and a call per request (SmolLM2-135M, a
    # prefill of 8 x 64 tokens on a 2-core CPU: its 30 layers' 240 calls took 34 ms, 6% of the
    # forward; batched, 23 ms). Half precision and single requests stay per request, bitwise HF's
    # own SDPA calls (tests/kernels/test_hf_rounding.py), as in decode_attention_fwd_torch. In
    # fp32 padding can only move a rounding (~1e-7); without padding (equally long prompts, no
    # cached prefix) the outputs came out bitwise the per-request ones.
    if (alibi_slopes is None and len(q_lens) > 1 and q.dtype not in (torch.float16, torch.bfloat16)
            and _padding_pays(q_lens, cached_lens)):
        _batched_sdpa_context(q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, q_lens, cached_lens,
                              sm_scale)
        return
    for req, q_start, q_len, cached in zip(b_req_idx.tolist(), b_q_start.tolist(), q_lens, cached_lens):
        if q_len == 0:
            continue
        slots = req_to_token[req, :cached + q_len].long()
        qi, k, v = q[q_start:q_start + q_len], k_cache[slots], v_cache[slots]
        if alibi_slopes is None:
            out = sdpa_attention(qi, k, v, sm_scale)
        else:
            out = _alibi_attention(qi, k, v, alibi_slopes, cached, sm_scale)
        o[q_start:q_start + q_len] = out.to(o.dtype)


# What a request's own SDPA call and gathers cost beyond their scores, in (query, key) pairs of a
# padded batch (SmolLM2's 9 heads of 64 on a 2-core CPU: ~100 us a request, ~17 ns a pair).
_CALL_SCORES = 4096


def _padding_pays(q_lens: list[int], cached_lens: list[int]) -> bool:
    """Whether one call on the batch padded to its longest request (every request's queries and
    keys) does less work than a call per request: not when one long request would make all the
    others as long (a 4000-token prompt with seven 10-token ones would attend 8 x 4000^2 scores
    instead of ~4000^2 / 2)."""
    padded = len(q_lens) * max(q_lens) * max(c + n for c, n in zip(cached_lens, q_lens))
    needed = sum(n * (c + n) for c, n in zip(cached_lens, q_lens))
    return padded <= 2 * needed + _CALL_SCORES * len(q_lens)


def _batched_sdpa_context(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor, req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor, b_q_start: torch.Tensor, q_lens: list[int], cached_lens: list[int], sm_scale: float,
) -> None:
    """`context_attention_fwd_torch` of the whole batch through one SDPA call, written into o.
    Queries and K/V are gathered padded to the batch's longest request (``[bs, Lq]`` and
    ``[bs, L]``); query j of request i sees key positions <= cached_i + j that request i has.
    GQA as `sdpa_attention` does it (enable_gqa)."""
    bs, (_, Hq, D), Hkv = len(q_lens), q.shape, k_cache.shape[1]
    Lq = max(q_lens)
    if Lq == 0:
        return
    kv_lens = [c + n for c, n in zip(cached_lens, q_lens)]
    L = max(kv_lens)
    dev = q.device
    req_rows = b_req_idx.long()
    if not any(cached_lens) and min(q_lens) == Lq:
        # The common prefill: no cached prefix, every prompt as long. No padding, and the causal
        # mask is SDPA's own (as per request).
        slots = req_to_token[req_rows, :L].reshape(-1)
        mask, q_rows, pad = None, None, None
    else:
        pos = torch.arange(L, device=dev)
        valid = pos[None, :] < torch.tensor(kv_lens, device=dev)[:, None]  # [bs, L]
        # Padding positions may hold any slot value in req_to_token: read slot 0 there instead.
        slots = req_to_token[req_rows, :L].masked_fill(~valid, 0).reshape(-1)
        pad = (~valid).reshape(-1).nonzero().squeeze(1)
        # Query j of request i sits at position cached_i + j. A padding query row (j >= q_len_i)
        # keeps a non-empty mask row (key 0; all of them up to kv_len_i) and its output is dropped.
        q_pos = torch.tensor(cached_lens, device=dev)[:, None] + pos[None, :Lq]  # [bs, Lq]
        mask = (pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [bs, Lq, L]
        mask[:, :, 0] = True
        q_valid = pos[None, :Lq] < torch.tensor(q_lens, device=dev)[:, None]  # [bs, Lq]
        q_rows = (b_q_start.long()[:, None] + pos[None, :Lq]).masked_fill(~q_valid, 0)  # into q / o
    k = k_cache.index_select(0, slots)  # [bs * L, Hkv, D]
    v = v_cache.index_select(0, slots)
    if pad is not None and pad.numel():
        # Slot 0 may hold anything (a never-written slot may be NaN), and the mask does not keep it
        # out: SDPA adds -inf to its score (NaN + -inf is NaN) and multiplies its probability 0 by
        # its V row (0 * NaN is NaN). So padding rows are zeroed (those rows only, in place).
        k.index_fill_(0, pad, 0)
        v.index_fill_(0, pad, 0)
    if mask is None and b_q_start.tolist() == list(range(0, bs * Lq, Lq)):
        # the requests' rows back to back in batch order (the model's prefill): views, no copies
        qb = q.narrow(0, 0, bs * Lq).unflatten(0, (bs, Lq))
    else:
        if q_rows is None:
            q_rows = b_q_start.long()[:, None] + torch.arange(Lq, device=dev)[None, :]
        qb = q.index_select(0, q_rows.reshape(-1)).view(bs, Lq, Hq, D)
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2), k.view(bs, L, Hkv, D).transpose(1, 2), v.view(bs, L, Hkv, D).transpose(1, 2),
        attn_mask=None if mask is None else mask[:, None], is_causal=mask is None and Lq > 1, scale=sm_scale,
        enable_gqa=Hq != Hkv,
    ).transpose(1, 2)  # [bs, Lq, Hq, D]
    if q_rows is None:
        o.narrow(0, 0, bs * Lq).unflatten(0, (bs, Lq)).copy_(out)
    elif mask is None:
        o.index_copy_(0, q_rows.reshape(-1), out.reshape(bs * Lq, Hq, D).to(o.dtype))
    else:
        o.index_copy_(0, q_rows[q_valid], out[q_valid].to(o.dtype))


def _alibi_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: torch.Tensor,
                     cached: int, sm_scale: float) -> torch.Tensor:
    """fp32 causal attention of q ``[n, Hq, D]`` at positions cached.. over k, v ``[L, Hkv, D]``
    with ALiBi. Not SDPA: its float mask must be in q's dtype, and slope * distance in bf16 would
    lose the bias's precision."""
    q_len, Hq, D = q.shape
    kv_len, Hkv = k.shape[0], k.shape[1]
    G = Hq // Hkv
    # Query heads grouped by kv head, so GQA needs no repeated K/V.
    qi = q.float().view(q_len, Hkv, G, D)
    scores = torch.einsum("qhgd,khd->hgqk", qi, k.float()) * sm_scale  # [Hkv, G, q, L]
    q_pos = torch.arange(cached, kv_len, device=q.device)
    k_pos = torch.arange(kv_len, device=q.device)
    rel = (k_pos[None, :] - q_pos[:, None]).float()  # kpos - p, [q, L]
    scores = scores + alibi_slopes.float().view(Hkv, G, 1, 1) * rel
    scores = scores.masked_fill(rel > 0, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hgqk,khd->qhgd", probs, v.float()).reshape(q_len, Hq, D)


def context_attention_fwd(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_q_start: torch.Tensor,
    b_q_len: torch.Tensor, b_cached_len: torch.Tensor, max_q_len: int,
    alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
) -> None:
    """Causal attention of new tokens over their requests' paged KV cache, written into o.

    q, o: [total_q, Hq, D]; k_cache, v_cache: [slots, Hkv, D] with the new tokens' K/V
    already in place; req_to_token: [max_reqs, max_len]; b_*: [bs]; max_q_len >= max(b_q_len).
    alibi_slopes: [Hq] fp32 or None (adds slope[h] * (kpos - p)); sm_scale defaults to 1/sqrt(D).
    """
    args = (q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, b_q_len, b_cached_len,
            max_q_len, alibi_slopes, sm_scale)
    if use_triton(q):
        context_attention_fwd_triton(*args)
    else:
        context_attention_fwd_torch(*args)
