"""Scatter new tokens' K or V rows into the KV pool: dest[dest_loc[i]] = src[i]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launcher, next_pow2, use_triton


@triton.jit
def _destindex_copy_kv_kernel(
    Src, DestLoc, Dest,
    stride_s_n, stride_s_h, stride_s_d,
    stride_d_n, stride_d_h, stride_d_d,
    H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per source token, copying all of its heads.
    i = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    # int64: slot * stride can pass 2**31 in a large pool.
    slot = tl.load(DestLoc + i).to(tl.int64)
    src = Src + i.to(tl.int64) * stride_s_n + offs_h[:, None] * stride_s_h + offs_d[None, :] * stride_s_d
    x = tl.load(src, mask=mask, other=0.0)
    dst = Dest + slot * stride_d_n + offs_h[:, None] * stride_d_h + offs_d[None, :] * stride_d_d
    tl.store(dst, x.to(Dest.dtype.element_ty), mask=mask)


def destindex_copy_kv_triton(src: torch.Tensor, dest_loc: torch.Tensor, dest: torch.Tensor) -> None:
    """Triton version of `destindex_copy_kv`."""
    n, H, D = src.shape
    if n == 0:
        return
    launcher(_destindex_copy_kv_kernel, src)[(n,)](
        src, dest_loc, dest,
        src.stride(0), src.stride(1), src.stride(2),
        dest.stride(0), dest.stride(1), dest.stride(2),
        H, D,
        BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D),
        num_warps=4,
    )


def destindex_copy_kv_torch(src: torch.Tensor, dest_loc: torch.Tensor, dest: torch.Tensor) -> None:
    """Torch twin of `destindex_copy_kv`."""
    dest[dest_loc.long()] = src.to(dest.dtype)


def destindex_copy_kv(src: torch.Tensor, dest_loc: torch.Tensor, dest: torch.Tensor) -> None:
    """dest[dest_loc[i]] = src[i] for src [n, H, D], dest_loc [n] (int32/int64), dest [slots, H, D]."""
    if use_triton(src):
        destindex_copy_kv_triton(src, dest_loc, dest)
    else:
        destindex_copy_kv_torch(src, dest_loc, dest)
