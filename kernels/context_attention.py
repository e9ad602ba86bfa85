"""Causal attention of new query tokens over a request's paged KV cache.

Serves prefill (cached 0), chunked prefill / prefix-cache hits and speculative
verification (cached > 0, several new tokens). Query j of request i is row
b_q_start[i] + j of q/o, sits at position p = b_cached_len[i] + j, and attends to key
positions 0..p, whose KV-pool slots are req_to_token[b_req_idx[i], pos].

The Triton kernel, FlashAttention-2 style (against the first version, H100, bf16, 8 x 2048:
958 -> 738 us; cuDNN 516; benchmarks/README.md):
  * Two key loops per query block, as Triton's fused-attention tutorial (STAGE 1 / STAGE 2):
    keys [0, full) lie at or below every query row of the block, so that loop has no causal mask,
    no `tl.where`, no load masks (and, when BLOCK_D == D, no head-dim masks either); only the
    keys [full, end) around the diagonal are masked. full is a multiple of BLOCK_N, so a cached
    prefix that is not a multiple of the tiles is handled by the masked loop alone.
  * The softmax scale: the unmasked loop takes the row max of the raw scores, scales that
    (one multiply a row) and then computes exp2(s * qk_scale - m) as one FMA an element. That
    costs what folding qk_scale into q would (one op an element) without rounding q * scale to
    bf16 a second time; the masked / ALiBi loop scales explicitly.
  * K is gathered as [BLOCK_N, D] (rows contiguous through the slot table, 16-byte vector loads)
    and fed as tl.trans(k); P @ V accumulates in place (tl.dot(p, v, acc)), no separate product.
  * The slot-table entries of the next key block are read one iteration ahead (loop-carried).
    With the table read inside the iteration, Triton 3.6's pipeliner sees the K/V gathers as
    indirect loads and pipelines them only one tile deep (`async_wait num=0` at the top of every
    iteration: the gathers' latency is exposed); carried, they get the full num_stages
    multi-buffering. This was the largest single gain (H100, 8 x 2048: 890 -> 775 us).
  * 32-bit K/V row offsets (slot * stride) when the pools' extent fits in int32 (OFF32).
  * Grid (heads, query blocks, requests), query blocks in reverse order (REQ_MAJOR): the programs
    in flight are one request's, so the K/V they read at a time fits in L2, and the blocks with
    the most keys (the end of a prompt) start first; neighbouring programs are neighbouring heads,
    which share K/V. (8 x 2048: 780 -> 730 us against the (heads, requests, blocks) order.)
  * PACK_GQA (chosen for short query runs): one program serves all GROUP query heads of a kv head,
    its BLOCK_M rows being (query, head-in-group) pairs, so each K/V tile is read once per kv head
    instead of GROUP times (speculative verification / chunks are memory-bound), and
    BLOCK_M = 16..64 rows are filled by GROUP x few queries.
  * Default tiles from an H100 sweep (`_default_tiles`), smaller ones for fp32.
  * A float8 cache (``--kv-cache-dtype fp8``) is gathered as stored and each tile cast to q's
    dtype in registers (exact); K's scale is folded into qk_scale, V's into the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import (
    LOG2E, dot_precision, gather_kv, gather_padded_kv, launcher, masked_attention, next_pow2, sdpa_attention, softmax_scale, use_triton,
)
from .triton_math import softcap as _softcap


@triton.jit
def _load_kv_tile(Base, slots, stride_t, stride_d, offs_n, end, offs_d, D,
                  MASK_N: tl.constexpr, EVEN_D: tl.constexpr):
    """[BLOCK_N, BLOCK_D] rows of the pool at `slots` (rows past `end` / columns past D read 0)."""
    ptrs = Base + slots[:, None] * stride_t + offs_d[None, :] * stride_d
    if MASK_N:
        if EVEN_D:
            return tl.load(ptrs, mask=(offs_n < end)[:, None], other=0.0)
        return tl.load(ptrs, mask=(offs_n < end)[:, None] & (offs_d < D)[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)


@triton.jit
def _attn_inner(
    acc, l_i, m_i, q,
    K_head, V_head, Req_row, stride_r_pos,
    stride_k_t, stride_k_d, stride_v_t, stride_v_d,
    offs_d, D, pos_m, slope_m, qk_scale, window, cap,
    lo, hi, end,
    MASKED: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HALF_MMA: tl.constexpr, EVEN_D: tl.constexpr, OFF32: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Online softmax over the keys [lo, hi): MASKED adds the causal mask (and key < end, and with
    HAS_WINDOW the sliding window: key > pos - window) and masks the gathers; otherwise every key
    is visible to every row of the block. HAS_SOFTCAP caps the scaled scores (cap is in the log2
    domain, like the scores).

    The slot-table entries of the next key block are loaded one iteration ahead into registers
    (loop-carried): with the table load inside the iteration, Triton 3.6's pipeliner treats the
    K/V gathers as indirect loads and pipelines them one tile deep only (`async_wait num=0` at
    the top of each iteration, H100: ~890 us for 8 x 2048 at best); carried, the gathers get the
    full `num_stages` multi-buffering (~775 us)."""
    offs_first = lo + tl.arange(0, BLOCK_N)
    slots_next = tl.load(Req_row + offs_first * stride_r_pos, mask=offs_first < end, other=0)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if OFF32:
            slots = slots_next  # row offsets fit in int32 (the wrapper checked the pool's extent)
        else:
            slots = slots_next.to(tl.int64)
        offs_next = offs_n + BLOCK_N
        slots_next = tl.load(Req_row + offs_next * stride_r_pos, mask=offs_next < end, other=0)
        k = _load_kv_tile(K_head, slots, stride_k_t, stride_k_d, offs_n, end, offs_d, D, MASKED, EVEN_D)
        if HALF_MMA:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
        if MASKED or HAS_ALIBI or HAS_SOFTCAP:
            s = s * qk_scale
            if HAS_SOFTCAP:
                s = _softcap(s, cap)
            if HAS_ALIBI:
                s += slope_m[:, None] * (offs_n[None, :] - pos_m[:, None]).to(tl.float32)
            if MASKED:
                visible = offs_n[None, :] <= pos_m[:, None]
                if HAS_WINDOW:
                    visible = visible & (offs_n[None, :] > pos_m[:, None] - window)
                s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if HAS_WINDOW:
                # A row may have seen no key yet (its window starts past this block): subtract 0
                # instead of its -inf max, so its probabilities are 0, not NaN (-inf - -inf).
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s - m_sub[:, None])
                alpha = tl.math.exp2(m_i - m_sub)
            else:
                p = tl.math.exp2(s - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
        else:
            # qk_scale >= 0 (the wrapper moves a negative scale's sign into q), so
            # max(s) * qk_scale is the max of the scaled scores; then one FMA an element.
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_kv_tile(V_head, slots, stride_v_t, stride_v_d, offs_n, end, offs_d, D, MASKED, EVEN_D)
        if HALF_MMA:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
        else:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _context_attention_kernel(
    Q, K, V, O, ReqToToken, BReqIdx, BQStart, BQLen, BCachedLen, Slopes,
    qk_scale,  # |sm_scale| * log2(e) * k_scale: the softmax runs on exp2
    v_scale,   # the cache's V scale (1 unless float8)
    window,    # HAS_WINDOW: query at p sees keys (p - window, p]
    cap,       # HAS_SOFTCAP: logit_softcap * log2(e)
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_r_req, stride_r_pos,
    GROUP, D,
    HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, HALF_MMA: tl.constexpr,
    PACK_GQA: tl.constexpr, NEGATE_Q: tl.constexpr, EVEN_D: tl.constexpr, OFF32: tl.constexpr,
    REQ_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    hid = tl.program_id(0)      # query head, or kv head with PACK_GQA
    if REQ_MAJOR:
        # grid (heads, query blocks, requests): a request's programs run together, so the K/V
        # they read at a time is one request's (L2-sized), heaviest (last) query blocks first
        start_m = tl.num_programs(1) - 1 - tl.program_id(1)
        b = tl.program_id(2)
    else:
        # grid (heads, requests, query blocks): the heaviest query blocks of all requests first
        b = tl.program_id(1)
        start_m = tl.num_programs(2) - 1 - tl.program_id(2)

    q_len = tl.load(BQLen + b)
    offs_r = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if PACK_GQA:
        # row r of the block: query r // GROUP of the request, query head kv_h * GROUP + r % GROUP
        kv_h = hid
        m_lo = (start_m * BLOCK_M) // GROUP
        m_hi = tl.minimum(((start_m + 1) * BLOCK_M - 1) // GROUP + 1, q_len)
        offs_m = offs_r // GROUP
        offs_h = kv_h * GROUP + offs_r % GROUP
    else:
        kv_h = hid // GROUP
        m_lo = start_m * BLOCK_M
        m_hi = tl.minimum((start_m + 1) * BLOCK_M, q_len)
        offs_m = offs_r
        offs_h = tl.zeros([BLOCK_M], tl.int32) + hid
    if m_lo >= q_len:
        return
    cached = tl.load(BCachedLen + b)
    q_start = tl.load(BQStart + b).to(tl.int64)
    req = tl.load(BReqIdx + b).to(tl.int64)

    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < q_len
    pos_m = cached + offs_m

    q_ptrs = (Q + (q_start + offs_m.to(tl.int64))[:, None] * stride_q_t + offs_h[:, None] * stride_q_h
              + offs_d[None, :] * stride_q_d)
    if EVEN_D:
        q = tl.load(q_ptrs, mask=m_valid[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=m_valid[:, None] & (offs_d < D)[None, :], other=0.0)
    if NEGATE_Q:
        q = -q  # exact: qk_scale is |sm_scale| * log2(e)
    if HALF_MMA:
        # compiled fp16/bf16: half-precision MMA operands (K and V tiles cast to q's dtype: a float8
        # cache's), fp32 accumulation and softmax statistics
        q = q.to(Q.dtype.element_ty)
    else:
        q = q.to(tl.float32)

    if HAS_ALIBI:
        slope_m = tl.load(Slopes + offs_h).to(tl.float32) * 1.4426950408889634  # into the log2 domain
    else:
        slope_m = tl.zeros([BLOCK_M], tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    K_head = K + kv_h * stride_k_h
    V_head = V + kv_h * stride_v_h
    Req_row = ReqToToken + req * stride_r_req
    # Keys [0, end): up to the block's last query. Keys [0, full) are <= every row's position
    # (padding rows past q_len sit further right still), so they need no mask; full <= end.
    end = cached + m_hi
    full = ((cached + m_lo + 1) // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        # Keys before the first row's window are seen by no row: start at its block. Keys from
        # the last row's window start on are inside every row's window: unmasked from there to
        # full; the blocks between are masked.
        lo = (tl.maximum(cached + m_lo - window + 1, 0) // BLOCK_N) * BLOCK_N
        mid = tl.cdiv(tl.maximum(end - window, 0), BLOCK_N) * BLOCK_N
        mid = tl.minimum(tl.maximum(mid, lo), full)
        acc, l_i, m_i = _attn_inner(
            acc, l_i, m_i, q, K_head, V_head, Req_row, stride_r_pos,
            stride_k_t, stride_k_d, stride_v_t, stride_v_d, offs_d, D, pos_m, slope_m, qk_scale, window, cap,
            lo, mid, end,
            MASKED=True, HAS_ALIBI=HAS_ALIBI, HAS_WINDOW=True, HAS_SOFTCAP=HAS_SOFTCAP,
            DOT_PRECISION=DOT_PRECISION, HALF_MMA=HALF_MMA, EVEN_D=EVEN_D, OFF32=OFF32, BLOCK_N=BLOCK_N,
        )
    else:
        mid = 0
    acc, l_i, m_i = _attn_inner(
        acc, l_i, m_i, q, K_head, V_head, Req_row, stride_r_pos,
        stride_k_t, stride_k_d, stride_v_t, stride_v_d, offs_d, D, pos_m, slope_m, qk_scale, window, cap,
        mid, full, end,
        MASKED=False, HAS_ALIBI=HAS_ALIBI, HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP,
        DOT_PRECISION=DOT_PRECISION, HALF_MMA=HALF_MMA, EVEN_D=EVEN_D, OFF32=OFF32, BLOCK_N=BLOCK_N,
    )
    # The diagonal: when full == 0 its first block holds key 0, which every row sees, so m_i is
    # finite after it and no row makes NaNs (with a window that need not hold: see _attn_inner).
    acc, l_i, m_i = _attn_inner(
        acc, l_i, m_i, q, K_head, V_head, Req_row, stride_r_pos,
        stride_k_t, stride_k_d, stride_v_t, stride_v_d, offs_d, D, pos_m, slope_m, qk_scale, window, cap,
        full, end, end,
        MASKED=True, HAS_ALIBI=HAS_ALIBI, HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP,
        DOT_PRECISION=DOT_PRECISION, HALF_MMA=HALF_MMA, EVEN_D=EVEN_D, OFF32=OFF32, BLOCK_N=BLOCK_N,
    )

    out = acc / l_i[:, None] * v_scale
    o_ptrs = (O + (q_start + offs_m.to(tl.int64))[:, None] * stride_o_t + offs_h[:, None] * stride_o_h
              + offs_d[None, :] * stride_o_d)
    if EVEN_D:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_valid[:, None])
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_valid[:, None] & (offs_d < D)[None, :])


_SMEM_CACHE: dict = {}


def _max_shared_memory(device: torch.device) -> int:
    """Opt-in shared memory per block of `device` (H100: 227 KiB), 0 when unknown."""
    if device.type != "cuda":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMEM_CACHE:
        try:
            props = triton.runtime.driver.active.utils.get_device_properties(idx)
            _SMEM_CACHE[idx] = int(props["max_shared_mem"])
        except Exception:  # noqa: BLE001 - older/newer Triton: fall back to torch, then to "unknown"
            _SMEM_CACHE[idx] = int(getattr(torch.cuda.get_device_properties(idx), "shared_memory_per_block_optin", 0))
    return _SMEM_CACHE[idx]


def _default_tiles(max_q_len: int, bs: int, Hq: int, Hkv: int, D: int, dtype: torch.dtype,
                      on_gpu: bool = True, max_smem: int = 232448) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, pack_gqa).

    From a sweep on an H100 (bf16, Hq 32, Hkv 8, D 128, Triton 3.6, request-major
    grid). Half precision, D <= 128:
      * up to 64 (query, head) rows a kv head (speculative verification): the group's query heads
        packed into one 16/32/64-row tile, K/V read once per kv head (memory-bound);
      * up to 512 rows (chunks of <= 128 tokens at group 4): packed 64-row tiles, 128-key blocks
        when there are too few programs to fill the 132 SMs (fewer, longer iterations), else 64;
      * prefill: 64 x 64 tiles over 4 warps, 3 stages (two programs an SM); prompts of 4096+
        tokens 128 x 128 over 8 warps (two warpgroups), which re-read K/V half as often, when the
        device has the 224 KiB of shared memory their 3 stages take.
    fp32 keeps small tiles (twice the bytes a K/V tile; ieee/tf32 dots); D > 128 smaller ones.
    """
    group = max(1, Hq // max(1, Hkv))
    big_d = D > 128
    rows = max_q_len * group
    if dtype == torch.float32 or not on_gpu:
        if rows <= 16:
            return 16, 32, 4, 2, True
        return (32 if big_d else 64), 32, 4, 2, False
    if big_d:
        return 64, 32, 4, 2, rows <= 64
    if rows <= 64:
        return max(16, next_pow2(rows)), 64, 4, 3, True
    if rows <= 512 and group > 1:
        n_programs = bs * Hkv * triton.cdiv(rows, 64)
        return 64, (128 if n_programs < 132 else 64), 4, 3, True
    if max_q_len >= 4096 and max_smem >= 229376 + 1024:
        return 128, 128, 8, 3, False
    return 64, 64, 4, 3, False


def _fits_int32(t: torch.Tensor) -> bool:
    """Whether every element offset of the pool `t` fits in int32 (32-bit row offsets)."""
    extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()) if n > 0)
    return extent < 2**31 - 1


def context_attention_fwd_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_q_start: torch.Tensor,
    b_q_len: torch.Tensor, b_cached_len: torch.Tensor, max_q_len: int,
    alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
    sliding_window: int = 0, logit_softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
    *, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
    pack_gqa: bool | None = None, offsets32: bool | None = None, req_major: bool | None = None,
    _half_mma: bool | None = None,
) -> None:
    """Triton version of `context_attention_fwd`; tiles may be forced (tests, tuning sweeps).

    pack_gqa: serve all query heads of a kv head in one program (rows = query x head-in-group).
    offsets32: 32-bit K/V row offsets (default: with BLOCK_M <= 64, when the pools allow it;
    forcing it on a pool too large for int32 is ignored).
    req_major: grid order (heads, query blocks, requests) rather than (heads, requests, query
    blocks): one request's programs at a time (default True).
    _half_mma: force the half-precision MMA path (tests under the interpreter; default: compiled
    fp16/bf16 on CUDA, as the current kernel)."""
    _launch(q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, b_q_len, b_cached_len, max_q_len,
               alibi_slopes, sm_scale, sliding_window, logit_softcap, k_scale, v_scale, block_m=block_m, block_n=block_n, num_warps=num_warps,
               num_stages=num_stages, pack_gqa=pack_gqa, offsets32=offsets32, req_major=req_major,
               _half_mma=_half_mma)


def _launch(
    q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, b_q_len, b_cached_len, max_q_len,
    alibi_slopes=None, sm_scale=None, sliding_window=0, logit_softcap=0.0, k_scale=1.0, v_scale=1.0, *, block_m=None, block_n=None, num_warps=None, num_stages=None,
    pack_gqa=None, offsets32=None, req_major=None, _half_mma=None,
):
    """The launch; returns Triton's compiled kernel (n_regs, n_spills, asm: for diagnostics)."""
    bs = b_req_idx.shape[0]
    _, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if bs == 0 or max_q_len <= 0:
        return None
    assert Hq % Hkv == 0, "Hq must be a multiple of Hkv"
    group = Hq // Hkv
    BLOCK_D = max(16, next_pow2(D))
    d_bm, d_bn, d_warps, d_stages, d_pack = _default_tiles(max_q_len, bs, Hq, Hkv, D, q.dtype, q.is_cuda,
                                                              _max_shared_memory(q.device))
    BLOCK_M, BLOCK_N = block_m or d_bm, block_n or d_bn
    num_warps, num_stages = num_warps or d_warps, num_stages or d_stages
    pack = d_pack if pack_gqa is None else pack_gqa
    pack = pack and group > 1
    fits32 = _fits_int32(k_cache) and _fits_int32(v_cache)
    off32 = fits32 and (BLOCK_M <= 64 if offsets32 is None else offsets32)
    half_mma = (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)) if _half_mma is None else _half_mma
    qk_scale = softmax_scale(sm_scale, D) * LOG2E * k_scale
    slopes = alibi_slopes if alibi_slopes is not None else q  # never read without HAS_ALIBI
    n_m = triton.cdiv(max_q_len * group, BLOCK_M) if pack else triton.cdiv(max_q_len, BLOCK_M)
    n_h = Hkv if pack else Hq
    req_major = True if req_major is None else req_major
    grid = (n_h, n_m, bs) if req_major else (n_h, bs, n_m)
    return launcher(_context_attention_kernel, q)[grid](
        q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, b_q_len, b_cached_len, slopes,
        abs(qk_scale), v_scale, sliding_window, logit_softcap * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        req_to_token.stride(0), req_to_token.stride(1),
        group, D,
        HAS_ALIBI=alibi_slopes is not None, HAS_WINDOW=sliding_window > 0, HAS_SOFTCAP=logit_softcap > 0,
        DOT_PRECISION=dot_precision(q.dtype), HALF_MMA=half_mma, PACK_GQA=pack, NEGATE_Q=qk_scale < 0, EVEN_D=BLOCK_D == D, OFF32=off32, REQ_MAJOR=req_major,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        num_warps=num_warps, num_stages=num_stages,
    )


def context_attention_fwd_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_q_start: torch.Tensor,
    b_q_len: torch.Tensor, b_cached_len: torch.Tensor, max_q_len: int,
    alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
    sliding_window: int = 0, logit_softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Torch twin of `context_attention_fwd`: a batch of several fp32 requests in one SDPA call
    (`_batched_sdpa_context`); one request, or half precision, per request: gather K/V and attend
    through SDPA as HF does (`sdpa_attention`); with ALiBi biases, per request with an fp32 softmax.
    A float8 cache's rows are dequantized as they are gathered (`gather_kv`)."""
    sm_scale = softmax_scale(sm_scale, q.shape[-1])
    scales = (k_scale, v_scale)
    q_lens, cached_lens = b_q_len.tolist(), b_cached_len.tolist()
    if sliding_window or logit_softcap:
        if alibi_slopes is not None:
            raise NotImplementedError("ALiBi with a sliding window or soft-capping")
        _masked_context(q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, q_lens, cached_lens, sm_scale,
                        sliding_window, logit_softcap, scales)
        return
    # One SDPA call for the batch rather than gathers and a call per request (SmolLM2-135M, a
    # prefill of 8 x 64 tokens on a 2-core CPU: its 30 layers' 240 calls took 34 ms, 6% of the
    # forward; batched, 23 ms). Half precision and single requests stay per request, bitwise HF's
    # own SDPA calls (tests/kernels/test_hf_rounding.py), as in decode_attention_fwd_torch. In
    # fp32 padding can only move a rounding (~1e-7); without padding (equally long prompts, no
    # cached prefix) the outputs came out bitwise the per-request ones.
    if (alibi_slopes is None and len(q_lens) > 1 and q.dtype not in (torch.float16, torch.bfloat16)
            and _padding_pays(q_lens, cached_lens)):
        _batched_sdpa_context(q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, q_lens, cached_lens,
                              sm_scale, scales)
        return
    for req, q_start, q_len, cached in zip(b_req_idx.tolist(), b_q_start.tolist(), q_lens, cached_lens):
        if q_len == 0:
            continue
        slots = req_to_token[req, :cached + q_len].long()
        qi, (k, v) = q[q_start:q_start + q_len], gather_kv(k_cache, v_cache, slots, q.dtype, scales)
        if alibi_slopes is None:
            out = sdpa_attention(qi, k, v, sm_scale)
        else:
            out = _alibi_attention(qi, k, v, alibi_slopes, cached, sm_scale)
        o[q_start:q_start + q_len] = out.to(o.dtype)


def _masked_context(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor, req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor, b_q_start: torch.Tensor, q_lens: list[int], cached_lens: list[int], sm_scale: float,
    sliding_window: int, logit_softcap: float, scales: tuple[float, float],
) -> None:
    """`context_attention_fwd_torch` with a sliding window or soft-capping, per request as HF's
    eager attention (`masked_attention`). Keys before the first query's window are not gathered."""
    for req, q_start, q_len, cached in zip(b_req_idx.tolist(), b_q_start.tolist(), q_lens, cached_lens):
        if q_len == 0:
            continue
        first = max(0, cached - sliding_window + 1) if sliding_window else 0
        slots = req_to_token[req, first:cached + q_len].long()
        out = masked_attention(q[q_start:q_start + q_len], *gather_kv(k_cache, v_cache, slots, q.dtype, scales),
                               sm_scale, sliding_window, logit_softcap)
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
    scales: tuple[float, float] = (1.0, 1.0),
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
    k, v, valid = gather_padded_kv(k_cache, v_cache, req_to_token, b_req_idx.long(),
                                   torch.tensor(kv_lens, device=dev), L, q.dtype, scales)
    if not any(cached_lens) and min(q_lens) == Lq:
        # The common prefill: no cached prefix, every prompt as long. No padding, and the causal
        # mask is SDPA's own (as per request).
        mask, q_rows = None, None
    else:
        pos = torch.arange(L, device=dev)
        # Query j of request i sits at position cached_i + j. A padding query row (j >= q_len_i)
        # keeps a non-empty mask row (key 0; all of them up to kv_len_i) and its output is dropped.
        q_pos = torch.tensor(cached_lens, device=dev)[:, None] + pos[None, :Lq]  # [bs, Lq]
        mask = pos[None, None, :] <= q_pos[:, :, None]  # [bs, Lq, L]
        if valid is not None:
            mask &= valid[:, None, :]
        mask[:, :, 0] = True
        q_valid = pos[None, :Lq] < torch.tensor(q_lens, device=dev)[:, None]  # [bs, Lq]
        q_rows = (b_q_start.long()[:, None] + pos[None, :Lq]).masked_fill(~q_valid, 0)  # into q / o
    if mask is None and b_q_start.tolist() == list(range(0, bs * Lq, Lq)):
        # the requests' rows back to back in batch order (the model's prefill): views, no copies
        qb = q.narrow(0, 0, bs * Lq).unflatten(0, (bs, Lq))
    else:
        if q_rows is None:
            q_rows = b_q_start.long()[:, None] + torch.arange(Lq, device=dev)[None, :]
        qb = q.index_select(0, q_rows.reshape(-1)).view(bs, Lq, Hq, D)
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
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
    sliding_window: int = 0, logit_softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Causal attention of new tokens over their requests' paged KV cache, written into o.

    q, o: [total_q, Hq, D]; k_cache, v_cache: [slots, Hkv, D] with the new tokens' K/V
    already in place; req_to_token: [max_reqs, max_len]; b_*: [bs]; max_q_len >= max(b_q_len).
    alibi_slopes: [Hq] fp32 or None (adds slope[h] * (kpos - p)); sm_scale defaults to 1/sqrt(D).
    sliding_window: 0 (none) or W: the query at p sees keys p - W < kpos <= p (HF's sliding window).
    logit_softcap: 0 (none) or c: scores become c * tanh(score * sm_scale / c) before the mask.
    k_scale, v_scale: a float8 cache's scales (the real K is the stored one times k_scale); 1 otherwise.
    """
    args = (q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, b_q_len, b_cached_len,
            max_q_len, alibi_slopes, sm_scale, sliding_window, logit_softcap, k_scale, v_scale)
    if use_triton(q):
        context_attention_fwd_triton(*args)
    else:
        context_attention_fwd_torch(*args)
