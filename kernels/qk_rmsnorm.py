"""Qwen3's (and Gemma 3's) per-head q and k norms in one launch, in place: each head of q and of
k RMS-normalised over its ``head_dim`` (as `rmsnorm_forward`, Llama's or Gemma's rounding), q's
heads with one weight ``[D]`` and k's with another.

q and k are strided views of the fused qkv projection's output. Two `rmsnorm_forward` calls
would gather each into rows, normalise it and (k) copy it back into place: four or five launches
a layer, where each costs about as much as its work at decode time. Here one program per token
normalises all of its q and k heads where they lie.

The layers now hand the norms (`QKNorm`) to `rotary_emb_copy_kv`, which normalises, rotates and
stores in one launch (one less a layer: 48 of a Qwen3-30B-A3B decode step's ~600); this kernel is
the two-launch path its tests hold it to, and its twin the one the CPU runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .backend import launcher, next_pow2, pdl, use_triton
from .rmsnorm import rmsnorm_forward_torch
from .triton_math import pdl_wait


@dataclass(frozen=True)
class QKNorm:
    """A layer's per-head q and k norms (`qk_rmsnorm_`'s arguments), for `rotary_emb_copy_kv` to
    apply in its own launch."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    round_first: bool = True


@triton.jit
def _rmsnorm_heads(X, W, stride_h, H, D, eps, H_P2: tl.constexpr, D_P2: tl.constexpr, ROUND_FIRST: tl.constexpr):
    # RMSNorm of H rows of D (stride_h apart) at X, in place; the same order of operations as _rmsnorm_kernel.
    heads = tl.arange(0, H_P2)
    cols = tl.arange(0, D_P2)
    mask = (heads < H)[:, None] & (cols < D)[None, :]
    ptrs = X + heads[:, None] * stride_h + cols[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)
    h = x * rstd[:, None]
    if ROUND_FIRST:  # Llama: HF rounds the normalised value to x's dtype before the weight multiply
        h = h.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(ptrs, (w[None, :] * h).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _qk_rmsnorm_kernel(Q, K, WQ, WK, stride_qt, stride_qh, stride_kt, stride_kh, HQ, HK, D, eps,
                       HQ_P2: tl.constexpr, HK_P2: tl.constexpr, D_P2: tl.constexpr, ROUND_FIRST: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    _rmsnorm_heads(Q + token * stride_qt, WQ, stride_qh, HQ, D, eps, HQ_P2, D_P2, ROUND_FIRST)
    _rmsnorm_heads(K + token * stride_kt, WK, stride_kh, HK, D, eps, HK_P2, D_P2, ROUND_FIRST)


def qk_rmsnorm_triton_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       eps: float, round_first: bool = True) -> None:
    """Triton version of `qk_rmsnorm_`."""
    n, HQ, D = q.shape
    HK = k.shape[1]
    if n == 0:
        return
    HQ_P2, HK_P2, D_P2 = next_pow2(HQ), next_pow2(HK), next_pow2(D)
    launcher(_qk_rmsnorm_kernel, q)[(n,)](
        q, k, q_weight, k_weight, q.stride(0), q.stride(1), k.stride(0), k.stride(1), HQ, HK, D, eps,
        HQ_P2=HQ_P2, HK_P2=HK_P2, D_P2=D_P2, ROUND_FIRST=round_first,
        num_warps=4 if (HQ_P2 + HK_P2) * D_P2 <= 8192 else 8,
        **pdl(q),
    )


def qk_rmsnorm_torch_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      eps: float, round_first: bool = True) -> None:
    """Torch twin of `qk_rmsnorm_`: HF's q_norm and k_norm, written back in place."""
    q.copy_(rmsnorm_forward_torch(q, q_weight, eps, round_first))
    k.copy_(rmsnorm_forward_torch(k, k_weight, eps, round_first))


def qk_rmsnorm_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float, round_first: bool = True) -> None:
    """RMSNorm each head of q ``[n, Hq, D]`` with ``q_weight`` ``[D]`` and of k ``[n, Hk, D]``
    with ``k_weight``, in place (any token and head strides; unit-stride heads). round_first as
    `rmsnorm_forward`."""
    assert q.stride(2) == 1 and k.stride(2) == 1 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    if use_triton(q):
        qk_rmsnorm_triton_(q, k, q_weight, k_weight, eps, round_first)
    else:
        qk_rmsnorm_torch_(q, k, q_weight, k_weight, eps, round_first)
