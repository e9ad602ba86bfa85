"""Flash-decoding stage 2: merge the per-split partial outputs of stage 1 into o.

verify_attention's stage 1 writes every split of each query row (a split with no key the row
sees as a zero partial of log-sum-exp -inf), and takes this merge over all of them
(``b_seq_len`` None)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launcher, next_pow2, pdl
from .decode_attention_stage1 import first_key, split_length
from .triton_math import pdl_wait


@triton.jit(do_not_specialize=["num_splits"])  # as stage 1's
def _decode_attention_stage2_kernel(
    MidO, MidLse, O, BSeqLen,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_mo_d,
    stride_ml_b, stride_ml_h, stride_ml_s,
    stride_o_b, stride_o_h, stride_o_d,
    D, num_splits, window,
    HAS_WINDOW: tl.constexpr, ALL_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    if ALL_SPLITS:
        written = num_splits
    else:
        n_keys = tl.load(BSeqLen + b)
        n_keys -= first_key(n_keys, window, HAS_WINDOW)
        written = tl.cdiv(n_keys, split_length(n_keys, num_splits, BLOCK_N))  # the splits stage 1 wrote

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    mo_base = MidO + b.to(tl.int64) * stride_mo_b + h * stride_mo_h + offs_d * stride_mo_d
    ml_base = MidLse + b.to(tl.int64) * stride_ml_b + h * stride_ml_h

    # Online log-sum-exp merge (base 2) of the normalised split outputs.
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, written):
        lse = tl.load(ml_base + s * stride_ml_s)
        part = tl.load(mo_base + s * stride_mo_s, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + w * part
        total = total * alpha + w
        m = m_new

    o_ptrs = O + b.to(tl.int64) * stride_o_b + h * stride_o_h + offs_d * stride_o_d
    tl.store(o_ptrs, (acc / total).to(O.dtype.element_ty), mask=d_mask)


def decode_attention_stage2_triton(
    mid_o: torch.Tensor, mid_lse: torch.Tensor, o: torch.Tensor, b_seq_len: torch.Tensor | None,
    *, block_n: int, sliding_window: int = 0,
) -> None:
    """o[b, h] = softmax-weighted merge of stage 1's splits (mid_o [bs, Hq, splits, D], mid_lse
    [bs, Hq, splits]); block_n and sliding_window as stage 1 was given them. b_seq_len None:
    merge every split (each was written), b a query row rather than a request."""
    bs, Hq, D = o.shape
    launcher(_decode_attention_stage2_kernel, o)[(bs, Hq)](
        mid_o, mid_lse, o, b_seq_len if b_seq_len is not None else mid_lse,  # never read with ALL_SPLITS
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        D, mid_o.shape[2], sliding_window,
        HAS_WINDOW=sliding_window > 0, ALL_SPLITS=b_seq_len is None, BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)),
        num_warps=4,
        **pdl(o),
    )
