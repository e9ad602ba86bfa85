"""Rotary position embedding, in place, HF "rotate_half" (NeoX) layout.

x1 = x[..., :D/2], x2 = x[..., D/2:]; x1' = x1*cos - x2*sin; x2' = x2*cos + x1*sin.

Rounded as HF's ``apply_rotary_pos_emb`` rounds in x's dtype: cos/sin are cast to it first (HF's
rotary embedding returns them so), and each product and the sum round to it. In fp32 that is
plain fp32 math; in bf16 one rounding at the end instead would land a unit in the last place
away from HF's on a fifth of the values, enough to flip a near-tie greedy pick downstream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launcher, next_pow2, pdl, use_triton
from .triton_math import pdl_wait


@triton.jit
def _rotary_emb_kernel(
    X, Cos, Sin,
    stride_x_t, stride_x_h, stride_x_d,
    stride_c_t, stride_c_d, stride_s_t, stride_s_d,
    H, HALF,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    # Program (token t, block of heads); cos/sin are loaded once for all those heads.
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    mask = (offs_h[:, None] < H) & d_mask[None, :]
    dt = X.dtype.element_ty
    cos = tl.load(Cos + t * stride_c_t + offs_d * stride_c_d, mask=d_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * stride_s_t + offs_d * stride_s_d, mask=d_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    p1 = X + t * stride_x_t + offs_h[:, None] * stride_x_h + offs_d[None, :] * stride_x_d
    p2 = p1 + HALF * stride_x_d
    y1, y2 = rotate_halves(p1, p2, cos, sin, mask)
    tl.store(p1, y1, mask=mask)
    tl.store(p2, y2, mask=mask)


@triton.jit
def rotate_halves(P1, P2, cos, sin, mask):
    """The rotated halves (x1', x2'), in the dtype of x, of the heads of x whose halves P1, P2
    point at; cos and sin are fp32 holding values already rounded to that dtype. Shared with
    rotary_emb_copy_kv, so the two kernels round alike."""
    x1 = tl.load(P1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(P2, mask=mask, other=0.0).to(tl.float32)
    return rotate_values(x1, x2, cos, sin, P1.dtype.element_ty)


@triton.jit
def rotate_values(x1, x2, cos, sin, dt):
    """`rotate_halves` of halves already loaded (fp32 holding values of the dtype ``dt``)."""
    # Each product rounds to x's dtype before the sum, as HF's eager ops do (see the module doc);
    # the launch turns off FMA contraction, which would fuse a product into the sum.
    x1c, x2s = (x1 * cos).to(dt).to(tl.float32), (x2 * sin).to(dt).to(tl.float32)
    x2c, x1s = (x2 * cos).to(dt).to(tl.float32), (x1 * sin).to(dt).to(tl.float32)
    return (x1c - x2s).to(dt), (x2c + x1s).to(dt)


def _rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    n, H, D = x.shape
    if n == 0:
        return
    BLOCK_H = min(next_pow2(H), 16)
    launcher(_rotary_emb_kernel, x)[(n, triton.cdiv(H, BLOCK_H))](
        x, cos, sin,
        x.stride(0), x.stride(1), x.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        H, D // 2,
        BLOCK_H=BLOCK_H, BLOCK_HALF=next_pow2(D // 2), num_warps=4,
        # No fused multiply-add: compiled, x1*cos - x2*sin became fma(x1, cos, -x2s) in bf16, one
        # rounding fewer than HF's eager ops (and than the torch twin) on ~14% of values.
        enable_fp_fusion=False,
        **pdl(x),
    )


def rotary_emb_fwd_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Triton version of `rotary_emb_fwd`: one launch when k's heads follow q's in memory (the
    fused qkv projection lays them out so), else the same kernel on q, then on k."""
    both = _heads_of_both(q, k)
    if both is not None:
        _rotate_triton(both, cos, sin)
    else:
        _rotate_triton(q, cos, sin)
        _rotate_triton(k, cos, sin)


def _heads_of_both(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q's and k's heads as one ``[n, Hq + Hk, D]`` view, if k's heads continue q's in memory
    (same rows, same strides, k's first head right after q's last); else None."""
    n, hq, d = q.shape
    # A row stride matters only with more than one row: view() of one flat row may set q's and
    # k's differently (a batch-1 decode step's q and k, split from one projection, do).
    same_strides = k.stride()[1:] == q.stride()[1:] and (n <= 1 or k.stride(0) == q.stride(0))
    if (k.shape[0] != n or k.shape[2] != d or k.dtype != q.dtype or not same_strides
            or k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
            or k.storage_offset() != q.storage_offset() + hq * q.stride(1)):
        return None
    return q.as_strided((n, hq + k.shape[1], d), q.stride())


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # HF's apply_rotary_pos_emb, op for op in x's dtype (every eager op rounds to it), so bf16 on
    # CPU is bitwise HF's; rotate_half's -x2 makes x1*c + (-x2)*s, which is exactly x1*c - x2*s.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c = cos.to(x.dtype)[:, None, :]  # broadcast over heads
    s = sin.to(x.dtype)[:, None, :]
    x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def rotary_emb_fwd_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Torch twin of `rotary_emb_fwd`."""
    _rotate_torch(q, cos, sin)
    _rotate_torch(k, cos, sin)


def rotary_emb_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [n, Hq, D] and k [n, Hk, D] in place by cos, sin [n, D//2] (fp32), rounded as HF
    rounds (see the module doc)."""
    if use_triton(q):
        rotary_emb_fwd_triton(q, k, cos, sin)
    else:
        rotary_emb_fwd_torch(q, k, cos, sin)
