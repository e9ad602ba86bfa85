"""The edits of the logits (sampling/processors.py): penalties, min_tokens, and the grammar's mask
(guided decoding)."""

from __future__ import annotations

import os

import pytest
import torch

import llmserve.worker.sampling.processors as processors_module
from llmserve import kernels
from llmserve.sampling_params import SamplingParams
from llmserve.worker.sampling import Sampler
from sampler_test_utils import (
    GRAMMAR_CHARS, GRAMMAR_EOS, VOCAB, expected_penalized, grammar_sampler, make_sampler, random_logits,
    reference_apply_penalty,
)


# --------------------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["reference", "torch", "triton"])
def test_penalties_change_exactly_the_seen_tokens(
    implementation: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
):
    # "torch" and "triton" are the real kernel's two backends (on CPU, Triton interprets).
    if implementation == "triton" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs CPU tensors only interpreted; tests/kernels/test_apply_penalty.py covers it on cuda")
    if implementation == "reference":
        kernel = reference_apply_penalty
    else:
        kernel = kernels.apply_penalty
        kernels.set_backend(implementation)
        request.addfinalizer(lambda: kernels.set_backend(None))

    # Spy on the logits as the kernel leaves them.
    penalized: list[torch.Tensor] = []

    def spy(logits: torch.Tensor, *args) -> None:
        kernel(logits, *args)
        penalized.append(logits.clone())

    monkeypatch.setattr(processors_module, "apply_penalty", spy)

    requests = {
        0: SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25),
        1: SamplingParams(temperature=0),  # no penalties: untouched
        2: SamplingParams(temperature=0, repetition_penalty=0.8),
        3: SamplingParams(temperature=0, frequency_penalty=-1.0, presence_penalty=2.0),
    }
    prompts = {0: [3, 4, 4, 9], 1: [1, 2], 2: [5, 6, 7, 5], 3: [8]}
    outputs: dict[int, list[int]] = {req_id: [] for req_id in requests}
    sampler = make_sampler(requests, prompts)
    req_ids = list(requests)
    for step in range(4):
        logits = random_logits(len(req_ids), VOCAB, seed=step)
        logits[:, 20] += 50  # token 20 wins every step, so its output count grows
        logits[0, 9] = -2.0  # a negative logit: repetition multiplies
        raw = logits.clone()
        result = sampler.sample(logits, req_ids)
        for i, req_id in enumerate(req_ids):
            expected = expected_penalized(raw[i], requests[req_id], prompts[req_id], outputs[req_id])
            torch.testing.assert_close(penalized[-1][i], expected)
            assert result.token_ids[i] == expected.argmax().item()
            outputs[req_id].append(result.token_ids[i])
    assert outputs[0] == [20] * 4


def test_no_penalty_no_kernel_call(monkeypatch: pytest.MonkeyPatch):
    def must_not_run(*args) -> None:
        raise AssertionError("apply_penalty called for a batch without penalties")

    monkeypatch.setattr(processors_module, "apply_penalty", must_not_run)
    sampler = make_sampler({0: SamplingParams(), 1: SamplingParams(temperature=0)})
    sampler.sample(random_logits(2, VOCAB), [0, 1])


# --------------------------------------------------------------------------------------
# min_tokens
# --------------------------------------------------------------------------------------


EOS_IDS = (3, 4)


def eos_favoured_logits(num_rows: int) -> torch.Tensor:
    """EOS 3 is by far the likeliest, then stop id 7, then 9."""
    logits = random_logits(num_rows, VOCAB)
    logits[:, 3] += 40
    logits[:, 7] += 30
    logits[:, 9] += 20
    return logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_and_stop_ids_until_reached(temperature: float):
    requests = {
        0: SamplingParams(temperature=temperature, min_tokens=3, max_new_tokens=8, seed=0),
        1: SamplingParams(temperature=temperature, min_tokens=2, stop_token_ids=[7], seed=1, logprobs=0),
        2: SamplingParams(temperature=temperature, min_tokens=2, ignore_eos=True, seed=2),  # banned all the same
        3: SamplingParams(temperature=temperature, seed=3),
    }
    sampler = make_sampler(requests, eos_token_ids=EOS_IDS)
    tokens: dict[int, list[int]] = {req_id: [] for req_id in requests}
    logprobs: list[float] = []
    for _ in range(4):
        logits = eos_favoured_logits(len(requests))
        raw = torch.log_softmax(logits, dim=-1)
        result = sampler.sample(logits, list(requests))
        for req_id, token_id in zip(requests, result.token_ids):
            tokens[req_id].append(token_id)
        logprobs.append((result.logprobs[1], raw[1, result.token_ids[1]].item()))
    assert tokens[0] == [7, 7, 7, 3]      # the stop id 7 of another request is no ban here
    assert tokens[1] == [9, 9, 3, 3]
    assert tokens[2] == [7, 7, 3, 3]
    assert tokens[3] == [3, 3, 3, 3]
    for got, raw_logprob in logprobs:     # logprobs stay those of the raw logits
        assert got == pytest.approx(raw_logprob, abs=1e-5)


def test_min_tokens_count_survives_preemption():
    params = SamplingParams(temperature=0, min_tokens=4)
    sampler = Sampler(eos_token_ids=EOS_IDS)
    sampler.add_request(0, params, [0])
    tokens = [sampler.sample(eos_favoured_logits(1), [0]).token_ids[0] for _ in range(2)]
    sampler.add_request(0, params, [0])   # preempted, prefilled again: the count goes on
    tokens += [sampler.sample(eos_favoured_logits(1), [0]).token_ids[0] for _ in range(3)]
    assert tokens == [7, 7, 7, 7, 3]


def test_min_tokens_skips_ids_outside_the_vocabulary():
    sampler = Sampler(eos_token_ids=[3, VOCAB + 5])
    sampler.add_request(0, SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[-1, 10**6]), [0])
    assert sampler.sample(eos_favoured_logits(1), [0]).token_ids == [7]


# --------------------------------------------------------------------------------------
# Guided decoding (llguidance's bitmask)
# --------------------------------------------------------------------------------------

def run_to_end(sampler: Sampler, req_ids: list[int], steps: int, seed: int = 0) -> dict[int, str]:
    """Sample ``steps`` tokens for each request from random logits; their text up to EOS."""
    texts = {r: "" for r in req_ids}
    live = list(req_ids)
    for step in range(steps):
        if not live:
            break
        result = sampler.sample(random_logits(len(live), VOCAB, seed=seed * 1000 + step), live)
        assert result.errors == [None] * len(live)
        for req_id, token_id in zip(list(live), result.token_ids):
            if token_id == GRAMMAR_EOS:
                live.remove(req_id)
            else:
                texts[req_id] += GRAMMAR_CHARS[token_id]
    assert not live, "every request reaches EOS once its grammar is complete"
    return texts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_draws_stay_inside_the_grammar(grammar_compiler, temperature: float):
    import re

    from llmserve.sampling_params import GuidedDecodingParams

    regex = r"[0-9a-f]{2,5}-(x|yz)"
    # More constrained rows than PARALLEL_MASKS: their masks come from llguidance's thread pool.
    n = processors_module.PARALLEL_MASKS + 1
    requests = {i: SamplingParams(temperature=temperature, seed=i, guided_decoding=GuidedDecodingParams(regex=regex))
                for i in range(n)}
    requests[n] = SamplingParams(temperature=temperature, seed=6, guided_decoding=GuidedDecodingParams(
        json='{"type":"object","properties":{"a":{"enum":["xyz","fff"]}},"required":["a"]}'))
    sampler = grammar_sampler(grammar_compiler, requests)
    texts = run_to_end(sampler, list(requests), steps=40)
    for i in range(n):
        assert re.fullmatch(regex, texts[i]), texts[i]
    assert texts[n] in ('{"a":"xyz"}', '{"a":"fff"}')


def test_guided_greedy_is_the_argmax_over_allowed_tokens(grammar_compiler):
    from llmserve.sampling_params import GuidedDecodingParams

    params = SamplingParams(temperature=0.0, guided_decoding=GuidedDecodingParams(regex="[a-f]+"))
    sampler = grammar_sampler(grammar_compiler, {0: params, 1: SamplingParams(temperature=0.0)})
    logits = random_logits(2, VOCAB, seed=5)
    allowed = [GRAMMAR_CHARS.index(c) for c in "abcdef"]
    result = sampler.sample(logits.clone(), [0, 1])
    assert result.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
    assert result.token_ids[1] == int(logits[1].argmax()), "an unconstrained row beside it is left alone"


def test_guided_seeded_sampling_is_reproducible_and_survives_re_adding(grammar_compiler):
    from llmserve.sampling_params import GuidedDecodingParams

    params = SamplingParams(temperature=1.0, seed=7, guided_decoding=GuidedDecodingParams(regex="[0-9]{8}"))
    first = run_to_end(grammar_sampler(grammar_compiler, {0: params}), [0], steps=20)
    sampler = grammar_sampler(grammar_compiler, {0: params})
    sampler.sample(random_logits(1, VOCAB, seed=0), [0])
    sampler.add_request(0, params, [0])   # a preempted request comes back: its matcher goes on
    rest = run_to_end(sampler, [0], steps=20, seed=0)
    assert len(first[0]) == 8 and len(rest[0]) == 7


def test_unconstrained_batches_compute_no_mask(grammar_compiler, monkeypatch: pytest.MonkeyPatch):
    def fail(*args):
        raise AssertionError("a mask was computed")

    monkeypatch.setattr(processors_module, "_grammar_bitmask", fail)
    sampler = grammar_sampler(grammar_compiler, {0: SamplingParams(temperature=1.0, seed=1)})
    assert sampler.sample(random_logits(1, VOCAB), [0]).errors == [None]


def test_a_token_the_grammar_refuses_fails_only_its_request(grammar_compiler):
    from llmserve.sampling_params import GuidedDecodingParams

    # EOS banned by min_tokens once "7" completes the grammar: nothing is left to draw.
    params = SamplingParams(temperature=0.0, min_tokens=3, guided_decoding=GuidedDecodingParams(regex="7"))
    sampler = grammar_sampler(grammar_compiler, {0: params, 1: SamplingParams(temperature=0.0)})
    assert sampler.sample(random_logits(2, VOCAB), [0, 1]).token_ids[0] == GRAMMAR_CHARS.index("7")
    result = sampler.sample(random_logits(2, VOCAB, seed=1), [0, 1])
    assert result.errors[0] is not None and "grammar" in result.errors[0]
    assert result.errors[1] is None
