"""Repetition (HF), frequency and presence (OpenAI) penalties applied to logits in place.

For request i, p_token_ids[cum[i]:cum[i+1]] are the distinct token ids seen so far and
p_token_counts their counts in the generated output (0 if seen only in the prompt):
    l = l / rep if l > 0 else l * rep
    l -= frequency * count + presence * (count > 0)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launcher, next_pow2, use_triton


@triton.jit
def _apply_penalty_kernel(
    Logits, Presence, Frequency, Repetition, TokenIds, TokenCounts, CumSeqLen,
    stride_l_b, BLOCK: tl.constexpr,
):
    # Program (request b, block of its listed tokens). Ids are distinct per request, so no write races.
    b = tl.program_id(0)
    start = tl.load(CumSeqLen + b)
    end = tl.load(CumSeqLen + b + 1)
    offs = start + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < end
    ids = tl.load(TokenIds + offs, mask=mask, other=0)
    counts = tl.load(TokenCounts + offs, mask=mask, other=0)
    presence = tl.load(Presence + b)
    frequency = tl.load(Frequency + b)
    rep = tl.load(Repetition + b)
    ptrs = Logits + b.to(tl.int64) * stride_l_b + ids
    logit = tl.load(ptrs, mask=mask, other=0.0)
    logit = tl.where(logit > 0, logit / rep, logit * rep)
    logit = logit - (frequency * counts.to(tl.float32) + presence * (counts > 0).to(tl.float32))
    tl.store(ptrs, logit, mask=mask)


def apply_penalty_triton(
    logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
    p_token_ids: torch.Tensor, p_token_counts: torch.Tensor, p_cumsum_seq_len: torch.Tensor,
    p_max_len_in_batch: int,
) -> None:
    """Triton version of `apply_penalty`."""
    bs = logits.shape[0]
    if bs == 0 or p_max_len_in_batch <= 0:
        return
    assert logits.stride(1) == 1
    BLOCK = min(next_pow2(p_max_len_in_batch), 512)
    launcher(_apply_penalty_kernel, logits)[(bs, triton.cdiv(p_max_len_in_batch, BLOCK))](
        logits, presence, frequency, repetition, p_token_ids, p_token_counts, p_cumsum_seq_len,
        logits.stride(0), BLOCK=BLOCK, num_warps=4,
    )


def apply_penalty_torch(
    logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
    p_token_ids: torch.Tensor, p_token_counts: torch.Tensor, p_cumsum_seq_len: torch.Tensor,
    p_max_len_in_batch: int,
) -> None:
    """Torch twin of `apply_penalty`, vectorised over the whole batch."""
    bs = logits.shape[0]
    cum = p_cumsum_seq_len.long()
    lengths = cum[1:] - cum[:-1]
    rows = torch.repeat_interleave(torch.arange(bs, device=logits.device), lengths)
    start, end = int(cum[0]), int(cum[-1])
    ids = p_token_ids[start:end].long()
    counts = p_token_counts[start:end].float()
    logit = logits[rows, ids]
    rep = repetition[rows]
    logit = torch.where(logit > 0, logit / rep, logit * rep)
    logit = logit - (frequency[rows] * counts + presence[rows] * (counts > 0).float())
    logits[rows, ids] = logit


def apply_penalty(
    logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
    p_token_ids: torch.Tensor, p_token_counts: torch.Tensor, p_cumsum_seq_len: torch.Tensor,
    p_max_len_in_batch: int,
) -> None:
    """Penalise logits [bs, V] fp32 in place; presence/frequency/repetition [bs] fp32;
    p_token_ids/p_token_counts [T] int32; p_cumsum_seq_len [bs+1]; p_max_len_in_batch = max list length."""
    args = (logits, presence, frequency, repetition, p_token_ids, p_token_counts, p_cumsum_seq_len,
            p_max_len_in_batch)
    if use_triton(logits):
        apply_penalty_triton(*args)
    else:
        apply_penalty_torch(*args)
