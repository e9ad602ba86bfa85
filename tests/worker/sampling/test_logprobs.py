"""Logprobs under the raw logits (sampling/logprobs.py): of the sampled tokens, and of a prompt."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from llmserve.worker.sampling.logprobs import prompt_logprobs
from sampler_test_utils import VOCAB, make_sampler, random_logits


# --------------------------------------------------------------------------------------
# Sampled tokens
# --------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits(reference_penalty: None):
    requests = {
        0: SamplingParams(temperature=0.5, repetition_penalty=2.0, logprobs=3, seed=1),
        1: SamplingParams(temperature=0.0),
        2: SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=0),
        3: SamplingParams(top_k=5, logprobs=VOCAB + 10, seed=2),  # more than there are: all
    }
    sampler = make_sampler(requests, prompts={0: [1, 2, 3], 2: list(range(VOCAB))})
    logits = random_logits(4, VOCAB)
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    result = sampler.sample(logits.clone(), list(requests))

    assert result.logprobs[1] is None and result.top_logprobs[1] is None
    assert result.top_logprobs[2] == []
    for row, k in [(0, 3), (2, 0), (3, VOCAB)]:
        chosen = result.token_ids[row]
        assert math.isclose(result.logprobs[row], raw_logprobs[row, chosen].item(), rel_tol=1e-5, abs_tol=1e-6)
        values, ids = raw_logprobs[row].topk(k)
        assert [t for t, _ in result.top_logprobs[row]] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in result.top_logprobs[row]]), values)


# --------------------------------------------------------------------------------------
# Prompt logprobs
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_top", [0, 2, VOCAB + 1])
def test_prompt_logprobs_score_each_next_token(num_top: int):
    prompt = [5, 9, 9, 1, 30]
    logits = random_logits(len(prompt), VOCAB)
    logprobs, top = prompt_logprobs(logits, prompt, num_top)
    expected = torch.log_softmax(logits, dim=-1)
    assert logprobs[0] is None and top[0] is None
    assert len(logprobs) == len(top) == len(prompt)
    for pos in range(1, len(prompt)):
        assert logprobs[pos] == pytest.approx(expected[pos - 1, prompt[pos]].item(), abs=1e-6)
        values, ids = expected[pos - 1].topk(min(num_top, VOCAB))
        assert [t for t, _ in top[pos]] == ids.tolist()
        assert [v for _, v in top[pos]] == pytest.approx(values.tolist(), abs=1e-6)


def test_prompt_logprobs_of_a_one_token_prompt():
    assert prompt_logprobs(random_logits(1, VOCAB), [5], 3) == ([None], [None])
