"""Scatter new tokens' K or V rows into the KV pool: dest[dest_loc[i]] = src[i].

A float8 (e4m3) pool stores each value divided by its tensor's scale (``k_scale`` for the K heads,
the first half of src's, ``v_scale`` for the V heads), clamped to e4m3's range: vLLM's
``--kv-cache-dtype fp8``, whose scales dequantize (value = stored * scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launcher, next_pow2, pdl, use_triton
from .triton_math import pdl_wait

KV_FP8 = torch.float8_e4m3fn
KV_FP8_MAX = torch.finfo(KV_FP8).max    # 448


@triton.jit
def fp8_scaled(x, inv_scale):
    """x * inv_scale in fp32, clamped to e4m3's finite range (a cast would make NaN of what exceeds it)."""
    y = x.to(tl.float32) * inv_scale
    return tl.minimum(tl.maximum(y, -448.0), 448.0)


@triton.jit
def _destindex_copy_kv_kernel(
    Src, DestLoc, Dest,
    stride_s_n, stride_s_h, stride_s_d,
    stride_d_n, stride_d_h, stride_d_d,
    inv_k, inv_v,
    H, HK, D,
    QUANT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # One program per source token, copying all of its heads.
    pdl_wait(PDL)
    i = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    # int64: slot * stride can pass 2**31 in a large pool.
    slot = tl.load(DestLoc + i).to(tl.int64)
    src = Src + i.to(tl.int64) * stride_s_n + offs_h[:, None] * stride_s_h + offs_d[None, :] * stride_s_d
    x = tl.load(src, mask=mask, other=0.0)
    if QUANT:  # the first HK heads are K's, the others V's
        x = fp8_scaled(x, tl.where(offs_h < HK, inv_k, inv_v)[:, None])
    dst = Dest + slot * stride_d_n + offs_h[:, None] * stride_d_h + offs_d[None, :] * stride_d_d
    tl.store(dst, x.to(Dest.dtype.element_ty), mask=mask)


def kv_quantization(dest: torch.Tensor, k_scale: float, v_scale: float) -> tuple[bool, float, float]:
    """(whether ``dest`` is a float8 pool, 1 / k_scale, 1 / v_scale): what the store kernels take.
    Scales other than 1 belong to a float8 pool only."""
    if dest.dtype == KV_FP8:
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"KV-cache scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
        return True, 1.0 / k_scale, 1.0 / v_scale
    if k_scale != 1.0 or v_scale != 1.0:
        raise ValueError(f"KV-cache scales ({k_scale}, {v_scale}) given for a {dest.dtype} cache (float8 only)")
    return False, 1.0, 1.0


def destindex_copy_kv_triton(src: torch.Tensor, dest_loc: torch.Tensor, dest: torch.Tensor,
                             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Triton version of `destindex_copy_kv`."""
    n, H, D = src.shape
    quant, inv_k, inv_v = kv_quantization(dest, k_scale, v_scale)
    if n == 0:
        return
    launcher(_destindex_copy_kv_kernel, src)[(n,)](
        src, dest_loc, dest,
        src.stride(0), src.stride(1), src.stride(2),
        dest.stride(0), dest.stride(1), dest.stride(2),
        inv_k, inv_v,
        H, H // 2, D,
        QUANT=quant, BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D),
        num_warps=4,
        **pdl(src),
    )


def quantize_kv_torch(src: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """src ``[n, H, D]`` as a float8 pool stores it: its first H // 2 heads (K) times 1 / k_scale,
    the others (V) times 1 / v_scale, in fp32, clamped to e4m3's range, rounded to nearest even."""
    hk = src.shape[1] // 2
    inv = torch.tensor([1.0 / k_scale] * hk + [1.0 / v_scale] * (src.shape[1] - hk), dtype=torch.float32,
                       device=src.device)
    return (src.float() * inv[:, None]).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8)


def destindex_copy_kv_torch(src: torch.Tensor, dest_loc: torch.Tensor, dest: torch.Tensor,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Torch twin of `destindex_copy_kv`."""
    quant, _, _ = kv_quantization(dest, k_scale, v_scale)
    if quant:   # written as bytes: not every device's index_put takes float8
        dest.view(torch.uint8)[dest_loc.long()] = quantize_kv_torch(src, k_scale, v_scale).view(torch.uint8)
    else:
        dest[dest_loc.long()] = src.to(dest.dtype)


def destindex_copy_kv(src: torch.Tensor, dest_loc: torch.Tensor, dest: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """dest[dest_loc[i]] = src[i] for src [n, H, D], dest_loc [n] (int32/int64), dest [slots, H, D].
    A float8 dest (the KV pool of ``--kv-cache-dtype fp8``) gets src's first H // 2 heads (K)
    divided by k_scale and the others (V) by v_scale; any other dest takes scales of 1 only."""
    if use_triton(src):
        destindex_copy_kv_triton(src, dest_loc, dest, k_scale, v_scale)
    else:
        destindex_copy_kv_torch(src, dest_loc, dest, k_scale, v_scale)
