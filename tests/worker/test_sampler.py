"""The batched sampler: greedy, seeded sampling, top-k / top-p, penalties, logprobs."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable

import pytest
import torch

import llmserve.worker.sampler as sampler_module
from llmserve import kernels
from llmserve.sampling_params import SamplingParams
from llmserve.worker.sampler import Sampler
from sampler_test_utils import (
    GRAMMAR_CHARS, GRAMMAR_EOS, VOCAB, expected_penalized, grammar_sampler, make_sampler, random_logits,
    reference_apply_penalty,
)


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


# --------------------------------------------------------------------------------------
# Distributions
# --------------------------------------------------------------------------------------


def sample_many(logits: torch.Tensor, params: Callable[[int], SamplingParams], num_samples: int) -> Counter[int]:
    """Draw ``num_samples`` tokens from one row of logits, one seeded request per draw."""
    sampler = make_sampler({i: params(i) for i in range(num_samples)})
    batch = logits.expand(num_samples, -1).clone()
    return Counter(sampler.sample(batch, list(range(num_samples))).token_ids)


def top_k_top_p_allowed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    """The tokens HF's top-k then top-p warpers keep, spelled out as a loop."""
    order = sorted(range(len(logits)), key=lambda t: -logits[t].item())
    kept = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(logits[kept] / temperature, dim=-1).tolist()
    allowed, total = set(), 0.0
    for token, prob in zip(kept, probs):
        allowed.add(token)
        total += prob
        if total >= top_p:
            break
    return allowed


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 5, 1.0), (1.0, 0, 0.6), (0.7, 10, 0.8), (2.0, 3, 0.99), (1.0, 0, 0.01)],
)
def test_top_k_top_p_never_pick_excluded_tokens(temperature: float, top_k: int, top_p: float):
    logits = random_logits(VOCAB, seed=5)
    allowed = top_k_top_p_allowed(logits, temperature, top_k, top_p)
    params = lambda i: SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=i)
    counts = sample_many(logits, params, num_samples=4000)
    assert set(counts) <= allowed
    # ...and all the allowed ones do come up, unless they are vanishingly rare.
    probs = torch.softmax(logits / temperature, dim=-1)
    likely = {t for t in allowed if probs[t] / probs[list(allowed)].sum() > 0.005}
    assert likely <= set(counts)


def chi_square(counts: Counter[int], expected_probs: torch.Tensor, num_samples: int) -> float:
    expected_counts = [num_samples * p for p in expected_probs.tolist()]
    return sum((counts.get(t, 0) - e) ** 2 / e for t, e in enumerate(expected_counts) if e > 0)


def test_top_k_top_p_among_the_largest_cuts_where_the_whole_sort_does(monkeypatch: pytest.MonkeyPatch):
    """The CPU's shortcut (the cut among the largest logits) against the sort of whole rows: the
    same tokens kept, but where a token's cumulative probability is top_p to float rounding."""
    monkeypatch.setattr(sampler_module, "TOP_CANDIDATES", 64)
    vocab_size = 2000
    top_k = torch.tensor([0, 5, 64, 65, 1500, 0, 0, 0, 3, 0, 0, 100] * 6)
    top_p = torch.tensor([0.9, 1.0, 0.95, 1.0, 1.0, 0.5, 0.99, 1.0, 0.7, 0.999, 0.1, 0.8] * 6)
    logits = random_logits(len(top_k), vocab_size, seed=12)
    logits[:24] *= 0.1          # flat rows: nuclei wider than the candidates
    logits[48:, :20] += 20      # peaked rows: nuclei of a few tokens
    sorted_rows: list[int] = []
    whole_sort = sampler_module._sort_top_k_top_p

    def spy(rows: torch.Tensor, *args) -> torch.Tensor:
        sorted_rows.append(len(rows))
        return whole_sort(rows, *args)

    monkeypatch.setattr(sampler_module, "_sort_top_k_top_p", spy)
    got = sampler_module._apply_top_k_top_p(logits, top_k, top_p)
    assert 0 < sorted_rows[0] < len(top_k), "some rows cut among the candidates, some sorted whole"
    expected = whole_sort(logits, top_k, top_p)
    for row in range(len(top_k)):
        differ = (got[row].isinf() != expected[row].isinf()).nonzero().flatten().tolist()
        kept = ~got[row].isinf()
        assert torch.equal(got[row][kept], logits[row][kept])
        if differ:   # one token at the nucleus' edge
            assert len(differ) == 1 and top_p[row] < 1.0, row
            probs = torch.softmax(logits[row].double(), dim=-1)
            before = probs[probs > probs[differ[0]]].sum().item()
            assert before == pytest.approx(top_p[row].item(), abs=1e-4)


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.6, 0), (1.8, 0), (0.8, 4)])
def test_empirical_distribution_matches_softmax(temperature: float, top_k: int):
    vocab_size, num_samples = 8, 8000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 1.2])
    expected = torch.softmax(logits / temperature, dim=-1)
    if top_k:
        expected[expected.argsort(descending=True)[top_k:]] = 0
        expected /= expected.sum()
    params = lambda i: SamplingParams(temperature=temperature, top_k=top_k, seed=10_000 + i)
    counts = sample_many(logits, params, num_samples)
    dof = (top_k or vocab_size) - 1
    # The seeds are fixed, so this is deterministic; the bound is ~p = 1e-5 for 7 dof.
    assert chi_square(counts, expected, num_samples) < 4 * dof + 10


# --------------------------------------------------------------------------------------
# Penalties and logprobs
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

    monkeypatch.setattr(sampler_module, "apply_penalty", spy)

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

    monkeypatch.setattr(sampler_module, "apply_penalty", must_not_run)
    sampler = make_sampler({0: SamplingParams(), 1: SamplingParams(temperature=0)})
    sampler.sample(random_logits(2, VOCAB), [0, 1])


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
# Typical-p
# --------------------------------------------------------------------------------------


def hf_warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row through HF's own warpers, in the order ``_get_logits_processor`` builds them."""
    from transformers import (
        LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(params.typical_p))
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]


@pytest.mark.parametrize("vocab_size", [VOCAB, 1000])
def test_typical_p_masks_what_hf_masks(vocab_size: int):
    typical_p = torch.tensor([0.01, 0.2, 0.5, 0.9, 0.95, 0.999, 1.0] * 4)
    logits = random_logits(len(typical_p), vocab_size, seed=vocab_size)
    logits[7:14] *= 0.1   # flat rows keep many tokens
    logits[14:21, :10] += 20  # peaked rows keep few
    got = sampler_module._apply_typical_p(logits, typical_p)
    for row, p in enumerate(typical_p.tolist()):
        if p == 1.0:
            assert torch.equal(got[row], logits[row])
            continue
        expected = hf_warped(logits[row], SamplingParams(typical_p=p))
        assert torch.equal(got[row].isinf(), expected.isinf()), f"row {row}, typical_p={p}"
        kept = ~got[row].isinf()
        assert kept.any() and torch.equal(got[row][kept], logits[row][kept])


def test_warpers_chain_in_hf_order():
    params = [
        SamplingParams(temperature=0.7, typical_p=0.8),
        SamplingParams(temperature=1.3, top_k=20, typical_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.9, typical_p=0.9),
        SamplingParams(temperature=0.5, top_k=30, top_p=0.95, typical_p=0.3),
        SamplingParams(temperature=0.9, top_k=10),  # no typical-p: a row that skips it
    ]
    sampler = make_sampler(dict(enumerate(params)))
    logits = random_logits(len(params), 256, seed=11)
    got = sampler_module._warp(logits, [sampler._requests[i] for i in range(len(params))])
    for row, p in enumerate(params):
        torch.testing.assert_close(got[row], hf_warped(logits[row], p))


def test_typical_p_never_picks_excluded_tokens():
    logits = random_logits(VOCAB, seed=8)
    allowed = set((~hf_warped(logits, SamplingParams(typical_p=0.4)).isinf()).nonzero().flatten().tolist())
    assert 1 < len(allowed) < VOCAB
    counts = sample_many(logits, lambda i: SamplingParams(typical_p=0.4, seed=i), num_samples=2000)
    assert set(counts) == allowed


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
# Prompt logprobs
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_top", [0, 2, VOCAB + 1])
def test_prompt_logprobs_score_each_next_token(num_top: int):
    prompt = [5, 9, 9, 1, 30]
    logits = random_logits(len(prompt), VOCAB)
    logprobs, top = sampler_module.prompt_logprobs(logits, prompt, num_top)
    expected = torch.log_softmax(logits, dim=-1)
    assert logprobs[0] is None and top[0] is None
    assert len(logprobs) == len(top) == len(prompt)
    for pos in range(1, len(prompt)):
        assert logprobs[pos] == pytest.approx(expected[pos - 1, prompt[pos]].item(), abs=1e-6)
        values, ids = expected[pos - 1].topk(min(num_top, VOCAB))
        assert [t for t, _ in top[pos]] == ids.tolist()
        assert [v for _, v in top[pos]] == pytest.approx(values.tolist(), abs=1e-6)


def test_prompt_logprobs_of_a_one_token_prompt():
    assert sampler_module.prompt_logprobs(random_logits(1, VOCAB), [5], 3) == ([None], [None])


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
    n = sampler_module.PARALLEL_MASKS + 1
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

    monkeypatch.setattr(sampler_module, "_grammar_bitmask", fail)
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
