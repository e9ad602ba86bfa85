"""The Sampler as a whole: greedy rows, and seeded sampling that draws the same tokens whatever the
batch and across a request's re-adding (its state kept by request id)."""

from __future__ import annotations

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from sampler_test_utils import VOCAB, make_sampler, random_logits


# --------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=1e-9, seed=3)],
    ids=["temperature=0", "top_k=1", "tiny temperature"],
)
def test_greedy_is_argmax(params: SamplingParams):
    logits = random_logits(8, VOCAB)
    sampler = make_sampler({i: params for i in range(8)})
    result = sampler.sample(logits.clone(), list(range(8)))
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 8 and result.top_logprobs == [None] * 8


def test_low_temperature_approaches_greedy():
    logits = random_logits(64, VOCAB)
    sampler = make_sampler({i: SamplingParams(temperature=1e-3, seed=i) for i in range(64)})
    result = sampler.sample(logits.clone(), list(range(64)))
    assert result.token_ids == logits.argmax(dim=-1).tolist()


# --------------------------------------------------------------------------------------
# Reproducibility
# --------------------------------------------------------------------------------------


def logits_for(req_id: int, step: int) -> torch.Tensor:
    """Each request's logits depend on the request and the step only, not on the batch."""
    return random_logits(VOCAB, seed=1000 * req_id + step)


def run_steps(batch: dict[int, SamplingParams], num_steps: int) -> dict[int, list[int]]:
    sampler = make_sampler(batch, prompts={req_id: [req_id, 5, 6] for req_id in batch})
    tokens: dict[int, list[int]] = {req_id: [] for req_id in batch}
    req_ids = list(batch)
    for step in range(num_steps):
        logits = torch.stack([logits_for(req_id, step) for req_id in req_ids])
        for req_id, token_id in zip(req_ids, sampler.sample(logits, req_ids).token_ids):
            tokens[req_id].append(token_id)
    return tokens


def test_same_seed_same_tokens_whatever_the_batch(reference_penalty: None):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    others = {
        10: SamplingParams(temperature=0.0),
        11: SamplingParams(temperature=1.3, seed=99, logprobs=3),
        12: SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5),
        13: SamplingParams(),
    }
    alone = run_steps({1: seeded}, num_steps=8)[1]
    first = run_steps({1: seeded, **others}, num_steps=8)[1]
    middle = run_steps({10: others[10], 11: others[11], 1: seeded, 12: others[12]}, num_steps=8)[1]
    last = run_steps({**others, 1: seeded}, num_steps=8)[1]
    assert alone == first == middle == last
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_differ():
    flat = {req_id: SamplingParams(seed=req_id) for req_id in range(20)}
    tokens = run_steps(flat, num_steps=6)
    assert len({tuple(t) for t in tokens.values()}) == 20


def test_unseeded_requests_differ():
    logits = torch.zeros(20, 1000)  # uniform: every token equally likely
    sampler = make_sampler({i: SamplingParams() for i in range(20)})
    assert len(set(sampler.sample(logits, list(range(20))).token_ids)) > 10


def test_re_adding_a_request_keeps_its_state():
    params = SamplingParams(seed=7)
    logits = random_logits(VOCAB)

    uninterrupted = make_sampler({0: params})
    expected = [uninterrupted.sample(logits[None].clone(), [0]).token_ids[0] for _ in range(6)]

    resumed = make_sampler({0: params})
    tokens = [resumed.sample(logits[None].clone(), [0]).token_ids[0] for _ in range(3)]
    resumed.add_request(0, params, [0])  # e.g. preempted and prefilled again
    tokens += [resumed.sample(logits[None].clone(), [0]).token_ids[0] for _ in range(3)]
    assert tokens == expected

    resumed.remove_request(0)
    resumed.add_request(0, params, [0])  # a new request that reuses the id starts afresh
    assert resumed.sample(logits[None].clone(), [0]).token_ids[0] == expected[0]
