"""Decode attention (flash decoding, split-K) over the paged KV cache.

The query of request i sits at position b_seq_len[i] - 1 and attends to positions
0..b_seq_len[i] - 1, whose KV-pool slots are req_to_token[b_req_idx[i], pos].
The Triton path runs decode_attention_stage1 (per-split partials), whose last program of each
request and kv head merges the splits (`merge_counters`), or chains decode_attention_stage2 (merge
of the splits) after it. A float8 cache (``--kv-cache-dtype fp8``) holds
K / k_scale and V / v_scale: stage 1 dequantizes in registers, the twin the rows it gathers.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .backend import (
    LOG2E, gather_kv, gather_padded_kv, masked_attention, next_pow2, sdpa_attention, softmax_scale, use_triton,
)
from .decode_attention_stage1 import decode_attention_stage1_triton
from .decode_attention_stage2 import decode_attention_stage2_triton

# The Triton path cuts each request's keys into at most `decode_num_splits` splits, each a multiple
# of DECODE_BLOCK_N keys (see decode_attention_stage1).
DECODE_BLOCK_N = 64
DECODE_MAX_SPLITS = 32
# Stage 1's programs to aim for: about four per SM of an H100 (132 SMs). In a sweep on one
# (benchmarks/README.md), fewer splits than this left small batches latency-bound (a request of
# 512 keys alone: 11.3 us in 2 splits, 6.3 us in 8), and more only added partials to write and
# merge (batch 128 x 512 keys: 102 us in 1 split, 116 us in 8).
DECODE_TARGET_PROGRAMS = 512


# Stage 2 merged inside stage 1 (`decode_attention_stage1`'s MERGE: one launch a layer fewer):
# its counters, one zeroed int32 buffer per device, kept for the life of the process (CUDA graphs
# hold its address), each counter left zero by the call that used it. A worker runs one step at a
# time on one stream, so calls never share a counter at once. Opt-in (``LLMSERVE_DECODE_MERGE=1``)
# until the GPUs have run its tests and timed it against the two launches; the tests here turn it on.
MERGE_COUNTERS = 1 << 16
MERGE_ENV_VAR = "LLMSERVE_DECODE_MERGE"
_MERGE = os.environ.get(MERGE_ENV_VAR, "0").strip() == "1"
_merge_counters: dict[torch.device, torch.Tensor] = {}


def merge_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's merge counters, or None (merge in stage 2) where they are off, hold fewer than
    ``needed``, or would first be allocated inside a CUDA-graph capture (which would keep them in
    the graph's memory pool)."""
    if not _MERGE or needed > MERGE_COUNTERS:
        return None
    counters = _merge_counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        with torch.inference_mode(False):
            counters = _merge_counters[device] = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
    return counters


def decode_num_splits(batch_size: int, kv_heads: int) -> int:
    """How many splits a request's keys may be cut into, for a batch of batch_size requests.

    It reads the batch size only through its next power of two. A CUDA graph's bucket lies
    between a batch's size and that power (every power of two is a bucket), so a step replayed
    from a padded graph cuts every request exactly as the same step run eagerly does."""
    return max(1, min(DECODE_MAX_SPLITS, DECODE_TARGET_PROGRAMS // (next_pow2(batch_size) * kv_heads)))


def decode_attention_fwd_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_seq_len: torch.Tensor, max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
    sliding_window: int = 0, logit_softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
    *, num_splits: int | None = None, block_n: int = DECODE_BLOCK_N,
) -> None:
    """Triton version of `decode_attention_fwd`: at most `num_splits` splits a request (default:
    `decode_num_splits`), of a multiple of `block_n` keys each. max_seq_len is not read: the grid
    holds no length."""
    bs, Hq, D = q.shape
    if bs == 0:
        return
    num_splits = num_splits or decode_num_splits(bs, k_cache.shape[1])
    qk_scale = softmax_scale(sm_scale, D) * LOG2E * k_scale
    masks = dict(sliding_window=sliding_window, logit_softcap=logit_softcap, v_scale=v_scale)
    if num_splits == 1:
        # One split a request (batches of 64 and more): stage 1 writes o itself, one launch a layer
        # fewer and no fp32 scratch, with the same bits (see decode_attention_stage1_triton).
        decode_attention_stage1_triton(q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len,
                                       o[:, :, None], None, qk_scale, alibi_slopes, block_n=block_n, **masks)
        return
    # Scratch is fp32 whatever the model dtype: partials are merged before rounding.
    mid_o = torch.empty((bs, Hq, num_splits, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bs, Hq, num_splits), dtype=torch.float32, device=q.device)
    counters = merge_counters(q.device, bs * k_cache.shape[1])
    decode_attention_stage1_triton(
        q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, mid_o, mid_lse, qk_scale, alibi_slopes,
        block_n=block_n, o=o if counters is not None else None, counters=counters, **masks,
    )
    if counters is None:
        decode_attention_stage2_triton(mid_o, mid_lse, o, b_seq_len, block_n=block_n, sliding_window=sliding_window)


def decode_attention_fwd_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_seq_len: torch.Tensor, max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
    sliding_window: int = 0, logit_softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Torch twin of `decode_attention_fwd`: a batch of several fp32 requests in one SDPA call
    (`_batched_sdpa_decode`); one request, or half precision, per request through SDPA as HF
    does (`sdpa_attention`); with ALiBi biases, a padded batch with an fp32 softmax. A float8
    cache's rows are dequantized as they are gathered (`gather_kv`)."""
    if q.shape[0] == 0:
        return
    scales = (k_scale, v_scale)
    sm_scale = softmax_scale(sm_scale, q.shape[-1])
    if sliding_window or logit_softcap:
        if alibi_slopes is not None:
            raise NotImplementedError("ALiBi with a sliding window or soft-capping")
        # Per request as HF's eager attention; only the keys inside the window are gathered.
        for i, (req, seq_len) in enumerate(zip(b_req_idx.tolist(), b_seq_len.tolist())):
            first = max(0, seq_len - sliding_window) if sliding_window else 0
            slots = req_to_token[req, first:seq_len].long()
            o[i:i + 1] = masked_attention(q[i:i + 1], *gather_kv(k_cache, v_cache, slots, q.dtype, scales),
                                          sm_scale, sliding_window, logit_softcap)
        return
    if alibi_slopes is not None:
        o.copy_(_alibi_decode(q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_seq_len,
                              alibi_slopes, sm_scale, scales).to(o.dtype))
        return
    # One call for the batch, not 2 gathers and an SDPA call per request (at SmolLM2-135M's shapes,
    # batch 8, those were 720 small ops a decode step; its 30 layers' calls at ~70 keys took 15.8 ms
    # that way on a 2-core CPU, 4.3 ms batched). Half precision stays per request: padding
    # a request's keys to the batch's longest changes the order in which SDPA's CPU kernel sums
    # them, which moves a few percent of bf16/fp16 outputs by a unit in the last place, and the
    # twins there round bitwise as HF's per-sequence SDPA does (tests/kernels/test_hf_rounding.py).
    # In fp32 that is a rounding (~1e-7), far inside the fp32 parity tolerance. One request keeps
    # the per-request call, so it is bitwise HF's in every dtype.
    if q.shape[0] > 1 and q.dtype not in (torch.float16, torch.bfloat16):
        o.copy_(_batched_sdpa_decode(q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, sm_scale, scales))
        return
    for i, (req, seq_len) in enumerate(zip(b_req_idx.tolist(), b_seq_len.tolist())):
        slots = req_to_token[req, :seq_len].long()
        o[i:i + 1] = sdpa_attention(q[i:i + 1], *gather_kv(k_cache, v_cache, slots, q.dtype, scales), sm_scale)


def _batched_sdpa_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor, b_seq_len: torch.Tensor, sm_scale: float, scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Decode attention of the whole batch through one SDPA call: K/V gathered padded to the
    batch's longest request (not max_seq_len, which only bounds it), padding masked out. GQA as
    `sdpa_attention` does it (enable_gqa). Returns ``[bs, Hq, D]`` in q's dtype."""
    L = int(b_seq_len.max())  # one read of the lengths (a sync on GPU; this twin runs on CPU)
    k, v, valid = gather_padded_kv(k_cache, v_cache, req_to_token, b_req_idx.long(), b_seq_len, L, q.dtype, scales)
    out = F.scaled_dot_product_attention(
        q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=None if valid is None else valid[:, None, None, :],   # [bs, 1, 1, L], True = attend
        scale=sm_scale, enable_gqa=q.shape[1] != k.shape[2],
    )
    return out[:, :, 0]


def _alibi_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor, b_seq_len: torch.Tensor, max_seq_len: int, alibi_slopes: torch.Tensor,
    sm_scale: float, scales: tuple[float, float],
) -> torch.Tensor:
    """fp32 decode attention with ALiBi: K/V gathered padded to max_seq_len, masked softmax. Not
    SDPA: its float mask must be in q's dtype, and slope * distance in bf16 would lose precision."""
    bs, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    seq_len = b_seq_len.long()
    L = max_seq_len
    pos = torch.arange(L, device=q.device)
    valid = pos[None, :] < seq_len[:, None]  # [bs, L]
    # Padding positions may hold any slot value in req_to_token: read slot 0 there instead.
    slots = torch.where(valid, req_to_token[b_req_idx.long(), :L].long(), 0)
    k, v = (t.view(bs, L, Hkv, D) for t in gather_kv(k_cache, v_cache, slots.reshape(-1), torch.float32, scales))
    qg = q.float().view(bs, Hkv, G, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * sm_scale
    rel = (pos[None, :] - (seq_len - 1)[:, None]).float()  # kpos - p, [bs, L]
    scores = scores + alibi_slopes.float().view(1, Hkv, G, 1) * rel[:, None, None, :]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(bs, Hq, D)


def decode_attention_fwd(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_seq_len: torch.Tensor, max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
    sliding_window: int = 0, logit_softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """One decode step of attention, written into o.

    q, o: [bs, Hq, D]; k_cache, v_cache: [slots, Hkv, D] (current token's K/V already in);
    req_to_token: [max_reqs, max_len]; b_req_idx, b_seq_len: [bs]; max_seq_len >= max(b_seq_len).
    alibi_slopes: [Hq] fp32 or None (adds slope[h] * (kpos - p)); sm_scale defaults to 1/sqrt(D).
    sliding_window, logit_softcap: as `context_attention_fwd` (0: none).
    k_scale, v_scale: a float8 cache's scales (the real K is the stored one times k_scale); 1 otherwise.
    """
    args = (q, k_cache, v_cache, o, req_to_token, b_req_idx, b_seq_len, max_seq_len, alibi_slopes, sm_scale,
            sliding_window, logit_softcap, k_scale, v_scale)
    if use_triton(q):
        decode_attention_fwd_triton(*args)
    else:
        decode_attention_fwd_torch(*args)
