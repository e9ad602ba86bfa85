"""Rotary embedding and the KV-cache store of the new tokens in one launch.

A rotary layer used to run `rotary_emb_fwd` (q and k in place in the qkv projection) and then
`destindex_copy_kv` (K and V rows into their cache slots): two launches per layer, each a few
microseconds in a decode step's graph. This kernel rotates q in place and writes the rotated k,
with v unchanged, straight into the cache slots ``dest[dest_loc[i]]``. It does not write the
rotated k back into ``kv``: nothing reads K or V from the projection after the store (attention
reads them from the cache), so ``kv`` keeps the unrotated k.

Rounded exactly as `rotary_emb_fwd` rounds (it calls the same `rotate_halves`, and turns off FMA
contraction as that launch does), so q and the cache rows are bitwise the two-kernel path's. A float8
cache (``--kv-cache-dtype fp8``) stores the rotated K and V scaled as `destindex_copy_kv` does.

With ``qk_norm`` (Qwen3's and Gemma 3's per-head norms, `QKNorm`) each head of q and of k is
RMS-normalised first, rounded as `qk_rmsnorm_` rounds (the sum of squares in another order: within
a unit in the last place of that kernel's output): the norms' launch joins this one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launcher, next_pow2, pdl, use_triton
from .destindex_copy_kv import destindex_copy_kv_torch, fp8_scaled, kv_quantization
from .qk_rmsnorm import QKNorm, qk_rmsnorm_torch_
from .rotary_emb import rotary_emb_fwd_torch, rotate_halves, rotate_values
from .triton_math import pdl_wait

# Heads per program: the rotary kernel's block.
_MAX_BLOCK_H = 16


@triton.jit
def _rotary_emb_copy_kv_kernel(
    Q, KV, Cos, Sin, DestLoc, Dest,
    stride_q_t, stride_q_h, stride_q_d,
    stride_kv_t, stride_kv_h, stride_kv_d,
    stride_c_t, stride_c_d, stride_s_t, stride_s_d,
    stride_o_n, stride_o_h, stride_o_d,
    inv_k, inv_v,  # QUANT: a float8 cache stores K * inv_k and V * inv_v
    WQ, WK, eps,   # QK_NORM: q's and k's per-head norm weights [2 * HALF]
    HQ, HKV, HALF, Q_BLOCKS,
    QUANT: tl.constexpr, QK_NORM: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    # Program (token t, block of heads): the first Q_BLOCKS blocks are q's heads, rotated in
    # place; the others are kv heads, each program storing the same block of K and of V heads.
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    dt = Q.dtype.element_ty
    cos = tl.load(Cos + t * stride_c_t + offs_d * stride_c_d, mask=d_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * stride_s_t + offs_d * stride_s_d, mask=d_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    if blk < Q_BLOCKS:
        offs_h = blk * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < HQ) & d_mask[None, :]
        p1 = Q + t * stride_q_t + offs_h[:, None] * stride_q_h + offs_d[None, :] * stride_q_d
        p2 = p1 + HALF * stride_q_d
        if QK_NORM:
            x1, x2 = _normed_halves(p1, p2, WQ, mask, offs_d, d_mask, HALF, eps, ROUND_FIRST)
            y1, y2 = rotate_values(x1, x2, cos, sin, dt)
        else:
            y1, y2 = rotate_halves(p1, p2, cos, sin, mask)
        tl.store(p1, y1, mask=mask)
        tl.store(p2, y2, mask=mask)
    else:
        offs_h = (blk - Q_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < HKV) & d_mask[None, :]
        # int64: slot * stride can pass 2**31 in a large pool.
        slot = tl.load(DestLoc + t).to(tl.int64)
        src = KV + t * stride_kv_t + offs_h[:, None] * stride_kv_h + offs_d[None, :] * stride_kv_d
        dst = Dest + slot * stride_o_n + offs_h[:, None] * stride_o_h + offs_d[None, :] * stride_o_d
        out_dt = Dest.dtype.element_ty
        if QK_NORM:
            x1, x2 = _normed_halves(src, src + HALF * stride_kv_d, WK, mask, offs_d, d_mask, HALF, eps, ROUND_FIRST)
            k1, k2 = rotate_values(x1, x2, cos, sin, dt)
        else:
            k1, k2 = rotate_halves(src, src + HALF * stride_kv_d, cos, sin, mask)
        if QUANT:
            k1, k2 = fp8_scaled(k1, inv_k), fp8_scaled(k2, inv_k)
        tl.store(dst, k1.to(out_dt), mask=mask)
        tl.store(dst + HALF * stride_o_d, k2.to(out_dt), mask=mask)
        # V heads follow the K heads, in kv as in the cache; copied as they are, half by half.
        src += HKV * stride_kv_h
        dst += HKV * stride_o_h
        for half in tl.static_range(2):
            v = tl.load(src + half * HALF * stride_kv_d, mask=mask, other=0.0)
            if QUANT:
                v = fp8_scaled(v, inv_v)
            tl.store(dst + half * HALF * stride_o_d, v.to(out_dt), mask=mask)


@triton.jit
def _normed_halves(P1, P2, W, mask, offs_d, d_mask, HALF, eps, ROUND_FIRST: tl.constexpr):
    """The halves of the heads at P1, P2 (``[BLOCK_H, BLOCK_HALF]``) RMS-normalised over the whole
    head with W, rounded to their dtype as `qk_rmsnorm_`'s output is, as fp32."""
    dt = P1.dtype.element_ty
    x1 = tl.load(P1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(P2, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    h1, h2 = x1 * rstd, x2 * rstd
    if ROUND_FIRST:  # Llama's order: the normalised value rounds to the dtype before the weight multiply
        h1, h2 = h1.to(dt).to(tl.float32), h2.to(dt).to(tl.float32)
    w1 = tl.load(W + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return (w1 * h1).to(dt).to(tl.float32), (w2 * h2).to(dt).to(tl.float32)


def rotary_emb_copy_kv_triton(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              dest_loc: torch.Tensor, dest: torch.Tensor, k_scale: float = 1.0,
                              v_scale: float = 1.0, qk_norm: QKNorm | None = None) -> None:
    """Triton version of `rotary_emb_copy_kv`."""
    n, hq, d = q.shape
    hkv = kv.shape[1] // 2
    quant, inv_k, inv_v = kv_quantization(dest, k_scale, v_scale)
    if n == 0:
        return
    block_h = min(next_pow2(max(hq, hkv)), _MAX_BLOCK_H)
    q_blocks = triton.cdiv(hq, block_h)
    launcher(_rotary_emb_copy_kv_kernel, q)[(n, q_blocks + triton.cdiv(hkv, block_h))](
        q, kv, cos, sin, dest_loc, dest,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1), kv.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        dest.stride(0), dest.stride(1), dest.stride(2),
        inv_k, inv_v,
        *(qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps) if qk_norm else (q, q, 0.0),
        hq, hkv, d // 2, q_blocks,
        QUANT=quant, QK_NORM=qk_norm is not None, ROUND_FIRST=qk_norm is None or qk_norm.round_first,
        BLOCK_H=block_h, BLOCK_HALF=next_pow2(d // 2), num_warps=4,
        enable_fp_fusion=False,  # as rotary_emb's launch: no FMA, each product rounds to the dtype
        **pdl(q),
    )


def rotary_emb_copy_kv_torch(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             dest_loc: torch.Tensor, dest: torch.Tensor, k_scale: float = 1.0,
                             v_scale: float = 1.0, qk_norm: QKNorm | None = None) -> None:
    """Torch twin of `rotary_emb_copy_kv`: the ops' twins in sequence (this one also leaves k
    normalised and rotated in kv, which nothing reads)."""
    if qk_norm is not None:
        qk_rmsnorm_torch_(q, kv[:, : kv.shape[1] // 2], qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps,
                          qk_norm.round_first)
    rotary_emb_fwd_torch(q, kv[:, : kv.shape[1] // 2], cos, sin)
    destindex_copy_kv_torch(kv, dest_loc, dest, k_scale, v_scale)


def rotary_emb_copy_kv(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       dest_loc: torch.Tensor, dest: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                       qk_norm: QKNorm | None = None) -> None:
    """Rotate q ``[n, Hq, D]`` in place by cos, sin ``[n, D//2]`` (fp32), and store kv
    ``[n, 2 * Hkv, D]`` (K heads then V heads) with its K heads rotated into the cache rows
    ``dest[dest_loc[i]]`` (dest ``[slots, 2 * Hkv, D]``, dest_loc int32/int64): as
    ``rotary_emb_fwd(q, kv[:, :Hkv], cos, sin)`` then ``destindex_copy_kv(kv, dest_loc, dest)``,
    bitwise, except that kv's own k may be left unrotated. A float8 dest takes k_scale and
    v_scale as `destindex_copy_kv` does. ``qk_norm``: q's and k's heads RMS-normalised first
    (`qk_rmsnorm_` before the rest; kv's own k may be left as it was)."""
    if use_triton(q):
        rotary_emb_copy_kv_triton(q, kv, cos, sin, dest_loc, dest, k_scale, v_scale, qk_norm)
    else:
        rotary_emb_copy_kv_torch(q, kv, cos, sin, dest_loc, dest, k_scale, v_scale, qk_norm)
