"""Helpers shared by the sampler's tests (tests/worker/sampling/)."""

from __future__ import annotations

from collections import Counter

import torch

from llmserve.sampling_params import SamplingParams
from llmserve.worker.sampling import Sampler

VOCAB = 64

def reference_apply_penalty(
    logits: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
    p_token_ids: torch.Tensor,
    p_token_counts: torch.Tensor,
    p_cumsum_seq_len: torch.Tensor,
    p_max_len_in_batch: int,
) -> None:
    """The penalty kernel's contract, row by row, checking the inputs' layout on the way."""
    batch_size = logits.shape[0]
    assert p_token_ids.dtype == p_token_counts.dtype == p_cumsum_seq_len.dtype == torch.int32
    assert presence.shape == frequency.shape == repetition.shape == (batch_size,)
    assert p_cumsum_seq_len.shape == (batch_size + 1,)
    lengths = p_cumsum_seq_len.diff()
    assert p_max_len_in_batch == lengths.max().item()
    for i in range(batch_size):
        start, end = p_cumsum_seq_len[i].item(), p_cumsum_seq_len[i + 1].item()
        ids = p_token_ids[start:end].long()
        counts = p_token_counts[start:end].float()
        assert len(set(ids.tolist())) == len(ids), "token ids must be distinct per request"
        x = logits[i, ids]
        x = torch.where(x > 0, x / repetition[i], x * repetition[i])
        x = x - frequency[i] * counts - presence[i] * (counts > 0).float()
        logits[i, ids] = x


def make_sampler(requests: dict[int, SamplingParams], prompts: dict[int, list[int]] | None = None,
                 eos_token_ids: tuple[int, ...] = ()) -> Sampler:
    sampler = Sampler(eos_token_ids)
    for req_id, params in requests.items():
        sampler.add_request(req_id, params, (prompts or {}).get(req_id, [0]))
    return sampler


def random_logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def expected_penalized(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """The penalties of one row as a plain loop: repetition (HF) over prompt and output
    tokens, then presence and frequency (OpenAI) by output counts."""
    row = logits.clone()
    counts = Counter(output)
    for token in set(prompt) | set(output):
        x = row[token].item()
        x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        x -= params.frequency_penalty * counts[token] + params.presence_penalty * (counts[token] > 0)
        row[token] = x
    return row


# One character per token: digits, a few letters and JSON's punctuation; the last id is EOS.
GRAMMAR_CHARS = '0123456789abcdefxyz{}[]":,-'
GRAMMAR_EOS = len(GRAMMAR_CHARS)


def grammar_sampler(grammar_compiler, requests: dict[int, SamplingParams]) -> Sampler:
    sampler = Sampler([GRAMMAR_EOS], grammar=grammar_compiler)
    for req_id, params in requests.items():
        sampler.add_request(req_id, params, [0])
    return sampler
