"""Residual add and RMSNorm in one pass: ``h += delta`` (in place, rounded to h's dtype as a plain
add is), then HF LlamaRMSNorm of the new ``h``. A decoder layer does this between its attention
and its MLP; one kernel reads and writes the residual row once instead of twice, and launches
once instead of twice.

With ``delta_weight`` the delta is RMS-normalised first (``h += norm(delta)``): Gemma 2 and 3
normalise the attention's output before it joins the residual stream, and the MLP's input norm
follows, so the three are one launch instead of two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launcher, pdl, row_launch_config, use_triton
from .rmsnorm import rmsnorm_forward_torch, row_rstd, store_row_norm
from .triton_math import pdl_wait


@triton.jit
def normalised_delta(d, d_rstd, DeltaW, cols, mask, H, ROUND_FIRST: tl.constexpr):
    """A chunk ``d`` (fp32) of a delta whose row has 1 / rms ``d_rstd``, normalised by weight
    ``DeltaW`` as `_rmsnorm_kernel` normalises (rounded to the dtype of ``H``'s elements), back in fp32."""
    dtype = H.dtype.element_ty
    d = d * d_rstd
    if ROUND_FIRST:
        d = d.to(dtype).to(tl.float32)
    return (tl.load(DeltaW + cols, mask=mask, other=0.0).to(tl.float32) * d).to(dtype).to(tl.float32)


@triton.jit
def add_to_row(h_row, d, cols, mask):
    """``h += d`` on a chunk of the residual row at ``h_row`` (``d`` fp32), rounded to h's dtype as
    `h += delta` rounds it; returns the new values squared (fp32), for the norm that follows."""
    s = (tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32) + d).to(h_row.dtype.element_ty)
    tl.store(h_row + cols, s, mask=mask)
    s = s.to(tl.float32)
    return s * s


@triton.jit
def _add_rmsnorm_kernel(H, Delta, W, DeltaW, Y, stride_h, stride_d, stride_y, N, eps, BLOCK_N: tl.constexpr,
                        ROUND_FIRST: tl.constexpr, NORM_DELTA: tl.constexpr, PDL: tl.constexpr):
    # One program per row; rows wider than BLOCK_N are walked in chunks (twice: add, then scale;
    # with NORM_DELTA a first time, for the delta's own norm).
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    h_row = H + row * stride_h
    d_row = Delta + row * stride_d
    y_row = Y + row * stride_y
    if NORM_DELTA:
        d_rstd = row_rstd(d_row, N, eps, BLOCK_N)
    sq = tl.zeros([BLOCK_N], tl.float32)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = cols < N
        d = tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32)
        if NORM_DELTA:  # as _rmsnorm_kernel: the normalised delta, rounded to the dtype
            d = normalised_delta(d, d_rstd, DeltaW, cols, mask, H, ROUND_FIRST)
        sq += add_to_row(h_row, d, cols, mask)
    rstd = tl.math.rsqrt(tl.sum(sq, 0) / N + eps)
    tl.debug_barrier()                            # the second pass reads what the first wrote
    store_row_norm(h_row, W, y_row, N, rstd, BLOCK_N, ROUND_FIRST)


def add_rmsnorm_forward_triton(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                               round_first: bool = True, delta_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `add_rmsnorm_forward`."""
    n = h.shape[-1]
    h2, d2 = h.view(-1, n), delta.reshape(-1, n)
    y = torch.empty_like(h2)
    if h2.shape[0] > 0:
        block_n, num_warps = row_launch_config(n)
        launcher(_add_rmsnorm_kernel, h2)[(h2.shape[0],)](
            h2, d2, weight, weight if delta_weight is None else delta_weight, y, h2.stride(0), d2.stride(0),
            y.stride(0), n, eps, BLOCK_N=block_n, ROUND_FIRST=round_first, NORM_DELTA=delta_weight is not None,
            num_warps=num_warps, **pdl(h2),
        )
    return y.view(h.shape)


def add_rmsnorm_forward_torch(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                              round_first: bool = True, delta_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of `add_rmsnorm_forward`: HF's residual add, then LlamaRMSNorm (or GemmaRMSNorm);
    with ``delta_weight``, the delta's norm first (Gemma 2's post-attention norm)."""
    if delta_weight is not None:
        delta = rmsnorm_forward_torch(delta, delta_weight, eps, round_first)
    h.add_(delta)
    return rmsnorm_forward_torch(h, weight, eps, round_first)


def add_rmsnorm_forward(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                        round_first: bool = True, delta_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``h += delta`` in place (h: ``[n, N]`` with unit-stride rows), then RMSNorm of h with
    weight ``[N]``; returns the norm as a new tensor in h's dtype. round_first as `rmsnorm_forward`.
    With ``delta_weight`` ``[N]``, ``h += rmsnorm(delta, delta_weight)`` instead (the same eps and
    rounding)."""
    assert h.stride(-1) == 1 and delta.shape == h.shape, (h.shape, h.stride(), delta.shape)
    if use_triton(h):
        return add_rmsnorm_forward_triton(h, delta, weight, eps, round_first, delta_weight)
    return add_rmsnorm_forward_torch(h, delta, weight, eps, round_first, delta_weight)
