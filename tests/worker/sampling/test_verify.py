"""Sampler.verify: speculative verification of drafts, against step-by-step Sampler.sample.

The "model" here is a function of the request's tokens so far, so that a row of logits for a draft
position is exactly the row the non-speculative run sees once it has emitted that prefix. The logits
go to ``LLMSERVE_TEST_DEVICE`` (the CPU unless set), so that ``LLMSERVE_TEST_DEVICE=cuda`` checks
the sampler's device paths (pinned copies, one read) on a GPU.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest
import torch

import llmserve.worker.sampling.verify as verify_module
from llmserve.sampling_params import GuidedDecodingParams, SamplingParams
from llmserve.worker.sampling import Sampler
from parity_utils import TEST_DEVICE
from sampler_test_utils import (
    GRAMMAR_CHARS, GRAMMAR_EOS, VOCAB, expected_penalized, grammar_sampler, make_sampler,
    random_logits,
)

SMALL_VOCAB = 12
EOS = 3
DECIDE_GREEDY = verify_module._decide_greedy


def on_device(logits: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` on the test device."""
    return logits.to(TEST_DEVICE, copy=True)


def history_logits(req_id: int, tokens: list[int], vocab_size: int) -> torch.Tensor:
    """A bigram table plus noise that depends on the whole history: small vocabularies repeat
    tokens often, so penalties and min_tokens change the argmax."""
    bigram = random_logits(vocab_size, vocab_size, seed=req_id)[tokens[-1]]
    noise = random_logits(vocab_size, seed=hash((req_id, *tokens)) % 2**62)
    return bigram / 3 + noise / 6


def draft_for(rng: random.Random, continuation: list[int], vocab_size: int) -> list[int]:
    """A draft for one step: the true continuation, the same with one token wrong, random
    tokens, or none."""
    k = rng.randint(0, 6)
    kind = rng.choice(["exact", "one wrong", "random", "empty"])
    draft = continuation[:k]
    if kind == "one wrong" and draft:
        draft[rng.randrange(len(draft))] = rng.randrange(vocab_size)
    elif kind == "random":
        draft = [rng.randrange(vocab_size) for _ in range(k)]
    elif kind == "empty":
        draft = []
    return draft


def reference_run(sampler: Sampler, requests: dict[int, SamplingParams], prompts: dict[int, list[int]],
                  num_tokens: int, vocab_size: int):
    """``num_tokens`` tokens per request from step-by-step ``sample``, with their logprobs."""
    req_ids = list(requests)
    tokens = {r: [] for r in req_ids}
    logprobs = {r: [] for r in req_ids}
    for _ in range(num_tokens):
        logits = torch.stack([history_logits(r, prompts[r] + tokens[r], vocab_size) for r in req_ids])
        result = sampler.sample(on_device(logits), req_ids)
        assert result.errors == [None] * len(req_ids)
        for n, r in enumerate(req_ids):
            tokens[r].append(result.token_ids[n])
            logprobs[r].append((result.logprobs[n], result.top_logprobs[n]))
    return tokens, logprobs


def speculative_run(sampler: Sampler, requests: dict[int, SamplingParams], prompts: dict[int, list[int]],
                    reference: dict[int, list[int]], num_tokens: int, vocab_size: int, seed: int = 0):
    """At least ``num_tokens`` tokens per request from ``verify``, drafts made from the reference
    continuation (right, partly wrong or random); and how many (request, verify call) pairs that took."""
    rng = random.Random(seed)
    req_ids = list(requests)
    tokens = {r: [] for r in req_ids}
    logprobs = {r: [] for r in req_ids}
    verified = 0
    while any(len(tokens[r]) < num_tokens for r in req_ids):
        live = [r for r in req_ids if len(tokens[r]) < num_tokens]
        drafts = [draft_for(rng, reference[r][len(tokens[r]) :], vocab_size) for r in live]
        rows = [history_logits(r, prompts[r] + tokens[r] + draft[:j], vocab_size)
                for r, draft in zip(live, drafts) for j in range(len(draft) + 1)]
        logits = on_device(torch.stack(rows))
        result = sampler.verify(logits, live, drafts)
        assert torch.equal(logits.cpu(), torch.stack(rows)), "the caller's logits are left as they are"
        verified += len(live)
        assert result.errors == [None] * len(live)
        for n, r in enumerate(live):
            emitted = result.token_ids[n]
            assert 1 <= len(emitted) <= len(drafts[n]) + 1
            assert emitted[:-1] == drafts[n][: len(emitted) - 1], "emits an accepted draft prefix, then one token"
            tokens[r] += emitted
            if requests[r].logprobs is not None:
                assert len(result.logprobs[n]) == len(result.top_logprobs[n]) == len(emitted)
                logprobs[r] += list(zip(result.logprobs[n], result.top_logprobs[n]))
            else:
                assert result.logprobs[n] is None and result.top_logprobs[n] is None
    return tokens, logprobs, verified


def assert_same_logprobs(got: list, expected: list) -> None:
    for (logprob, top), (ref_logprob, ref_top) in zip(got, expected):
        assert logprob == pytest.approx(ref_logprob, abs=1e-5)
        assert [t for t, _ in top] == [t for t, _ in ref_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=1e-5)


# --------------------------------------------------------------------------------------
# Greedy: token for token what step-by-step sampling gives
# --------------------------------------------------------------------------------------

GREEDY_REQUESTS = {
    0: SamplingParams(temperature=0.0),
    1: SamplingParams(temperature=0.0, repetition_penalty=1.6, logprobs=2),
    2: SamplingParams(temperature=0.0, frequency_penalty=0.6, presence_penalty=0.3),
    3: SamplingParams(temperature=0.0, min_tokens=8, stop_token_ids=[5], logprobs=0),
    4: SamplingParams(top_k=1, repetition_penalty=0.7, frequency_penalty=-0.2, min_tokens=3, logprobs=3),
}


def test_greedy_verify_equals_step_by_step_sampling(reference_penalty: None):
    prompts = {r: [r, 7, 1, r] for r in GREEDY_REQUESTS}
    num_tokens = 30
    reference, ref_logprobs = reference_run(make_sampler(GREEDY_REQUESTS, prompts, (EOS,)), GREEDY_REQUESTS,
                                            prompts, num_tokens + 8, SMALL_VOCAB)
    tokens, logprobs, verified = speculative_run(make_sampler(GREEDY_REQUESTS, prompts, (EOS,)), GREEDY_REQUESTS,
                                              prompts, reference, num_tokens, SMALL_VOCAB)
    for r in GREEDY_REQUESTS:
        assert tokens[r] == reference[r][: len(tokens[r])], f"request {r}"
        if GREEDY_REQUESTS[r].logprobs is not None:
            assert_same_logprobs(logprobs[r], ref_logprobs[r])
    assert sum(map(len, tokens.values())) > 1.5 * verified, "drafts were accepted"
    # The penalties and min_tokens did change the greedy chain.
    assert EOS not in reference[3][:8] and 5 not in reference[3][:8] and {EOS, 5} & set(reference[3][8:])
    assert reference[1] != reference[0]



# An all-greedy batch finds its accepted runs on the host; beside a sampling request, the same greedy
# requests are decided on the device. Random rows have no ties, so the two must agree exactly.
HOST_PATH_REQUESTS = {
    0: SamplingParams(temperature=0.0),
    1: SamplingParams(temperature=0.0, logprobs=2),
    2: SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4, min_tokens=3,
                      stop_token_ids=[5], logprobs=0),
    # Every token banned below min_tokens: the argmax of such a row (token 0) is never accepted.
    3: SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=list(range(VOCAB))),
}


def test_greedy_batch_decided_on_the_host_equals_the_device_path(monkeypatch: pytest.MonkeyPatch):
    decided_on_host = []
    monkeypatch.setattr(verify_module, "_decide_greedy",
                        lambda *args: decided_on_host.append(1) or DECIDE_GREEDY(*args))
    rng = random.Random(0)
    greedy_ids, sampling_id = list(HOST_PATH_REQUESTS), 9
    alone = make_sampler(HOST_PATH_REQUESTS, eos_token_ids=(EOS,))
    mixed = make_sampler({**HOST_PATH_REQUESTS, sampling_id: SamplingParams(temperature=1.0, seed=0)},
                         eos_token_ids=(EOS,))
    emitted = 0
    for step in range(12):
        lengths = [rng.randint(0, 5) for _ in greedy_ids]
        starts = [sum(lengths[:i]) + i for i in range(len(lengths))]
        logits = random_logits(sum(lengths) + len(lengths), VOCAB, seed=step)
        # The raw argmax chain of each request's rows (its penalties may cut it), sometimes one token
        # wrong, or past the vocabulary where no penalty counts it (that would fail the request).
        # Request 3 drafts token 0: its rows' argmax while every token is banned.
        drafts = [logits[s : s + k].argmax(dim=-1).tolist() for s, k in zip(starts, lengths)]
        drafts[3] = [0] * lengths[3]
        for i in (0, 1, 2):
            if drafts[i] and rng.random() < 0.3:
                wrong = [rng.randrange(VOCAB), VOCAB + 2] if i < 2 else [rng.randrange(VOCAB)]
                drafts[i][rng.randrange(len(drafts[i]))] = rng.choice(wrong)
        host_path = alone.verify(on_device(logits), greedy_ids, drafts)
        device_path = mixed.verify(on_device(torch.cat([logits, random_logits(2, VOCAB, seed=100 + step)])),
                                 [*greedy_ids, sampling_id], [*drafts, [1]])
        assert host_path.token_ids == device_path.token_ids[:-1], f"step {step}"
        assert host_path.logprobs == device_path.logprobs[:-1]
        assert host_path.top_logprobs == device_path.top_logprobs[:-1]
        assert host_path.errors == device_path.errors[:-1] == [None] * len(greedy_ids)
        emitted += sum(map(len, host_path.token_ids))
        if step < 4:
            assert len(host_path.token_ids[3]) == 1, "a draft token of a row where every token is banned is refused"
    assert len(decided_on_host) == 12, "the greedy batches took the host's path, the mixed ones the device's"
    assert emitted > 1.5 * 12 * len(greedy_ids), "drafts were accepted"


# --------------------------------------------------------------------------------------
# Grammar: drafts walk the matcher, which is rolled back to what was accepted
# --------------------------------------------------------------------------------------

GUIDED = {
    0: GuidedDecodingParams(regex=r"[0-9a-f]{2,6}-(x|yz)"),
    1: GuidedDecodingParams(json='{"type":"object","properties":{"a":{"enum":["xyz","fff"]}},"required":["a"],"additionalProperties":false}'),
    2: GuidedDecodingParams(regex="[a-f1]+"),
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_verify_stays_in_the_grammar_and_greedy_equals_sampling(grammar_compiler, temperature: float):
    greedy = {r: SamplingParams(temperature=0.0, guided_decoding=g) for r, g in GUIDED.items()}
    requests = {r: SamplingParams(temperature=temperature, seed=r, guided_decoding=g, logprobs=1)
                for r, g in GUIDED.items()}
    prompts = {r: [0] for r in GUIDED}   # grammar_sampler's prompt
    num_tokens = 24
    reference, _ = reference_run(grammar_sampler(grammar_compiler, greedy), greedy, prompts, num_tokens + 8, VOCAB)
    tokens, _, verified = speculative_run(grammar_sampler(grammar_compiler, requests), requests, prompts, reference,
                                          num_tokens, VOCAB)
    if temperature == 0.0:
        for r in GUIDED:
            assert tokens[r] == reference[r][: len(tokens[r])], f"request {r}"
        assert sum(map(len, tokens.values())) > 1.5 * verified, "drafts were accepted"
    texts = {}
    for r in GUIDED:
        end = tokens[r].index(GRAMMAR_EOS) if GRAMMAR_EOS in tokens[r] else len(tokens[r])
        texts[r] = "".join(GRAMMAR_CHARS[t] for t in tokens[r][:end])
        assert set(tokens[r][end:]) <= {GRAMMAR_EOS}, "past the end of its grammar, a request can only end"
    assert re.fullmatch(GUIDED[0].regex, texts[0]) and re.fullmatch(GUIDED[2].regex, texts[2])
    assert texts[1] in ('{"a":"xyz"}', '{"a":"fff"}')


# --------------------------------------------------------------------------------------
# Sampling: the distribution of the emitted tokens is the non-speculative one
# --------------------------------------------------------------------------------------

DIST_VOCAB = 8
DIST_PROMPT = [0, 1, 2]


def step_probs(history: list[int], params: SamplingParams) -> torch.Tensor:
    """The distribution non-speculative sampling draws the next token from, spelled out: penalties
    (prompt and output), temperature, top-k."""
    logits = expected_penalized(history_logits(0, history, DIST_VOCAB), params, DIST_PROMPT,
                                history[len(DIST_PROMPT) :]) / params.temperature
    if params.top_k:
        logits[logits.argsort(descending=True)[params.top_k :]] = float("-inf")
    return torch.softmax(logits, dim=-1)


def likeliest(history: list[int], n: int) -> list[int]:
    """The raw argmax chain of ``n`` tokens after ``history``: a draft that is often right."""
    chain: list[int] = []
    for _ in range(n):
        chain.append(int(history_logits(0, history + chain, DIST_VOCAB).argmax()))
    return chain


def unlikeliest(history: list[int], n: int) -> list[int]:
    chain: list[int] = []
    for _ in range(n):
        chain.append(int(history_logits(0, history + chain, DIST_VOCAB).argmin()))
    return chain


def first_two_tokens(params: SamplingParams, first_draft: list[int], num_samples: int) -> Counter[tuple[int, int]]:
    """The first two tokens of ``num_samples`` seeded requests under ``verify``: ``first_draft``
    at the first step, the likeliest chain after that."""
    sampler = Sampler([])
    for i in range(num_samples):
        sampler.add_request(i, SamplingParams(**{**vars(params), "seed": 50_000 + i}), DIST_PROMPT)
    tokens: dict[int, list[int]] = {i: [] for i in range(num_samples)}
    live = list(tokens)
    while live:
        drafts = [first_draft if not tokens[i] else likeliest(DIST_PROMPT + tokens[i], 2) for i in live]
        rows = [history_logits(0, DIST_PROMPT + tokens[i] + d[:j], DIST_VOCAB)
                for i, d in zip(live, drafts) for j in range(len(d) + 1)]
        result = sampler.verify(on_device(torch.stack(rows)), live, drafts)
        for i, emitted in zip(live, result.token_ids):
            tokens[i] += emitted
        live = [i for i in live if len(tokens[i]) < 2]
    return Counter((t[0], t[1]) for t in tokens.values())


def chi_square_pooled(counts: Counter, expected: dict, num_samples: int) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, cells expecting fewer than 5 pooled into one."""
    assert set(counts) <= {cell for cell, p in expected.items() if p > 0}, "a token of probability 0 came out"
    stat, cells, pooled_count, pooled_expected = 0.0, 0, 0, 0.0
    for cell, p in expected.items():
        e = p * num_samples
        if e < 5:
            pooled_count += counts.get(cell, 0)
            pooled_expected += e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        cells += 1
    if pooled_expected > 0:
        stat += (pooled_count - pooled_expected) ** 2 / pooled_expected
        cells += 1
    return stat, cells - 1


def self_repeating(params: SamplingParams, n: int) -> list[int]:
    """``n`` times the token likeliest to come out twice in a row were its first occurrence not
    penalised: a draft whose second token only penalties that count the first one make unlikely."""
    unpenalised = SamplingParams(temperature=params.temperature, top_k=params.top_k)
    first = step_probs(DIST_PROMPT, params)
    token = max(range(DIST_VOCAB), key=lambda t: first[t] * step_probs(DIST_PROMPT + [t], unpenalised)[t])
    return [token] * n


DISTRIBUTION_CASES = {
    "likely draft": (SamplingParams(temperature=1.0), lambda: likeliest(DIST_PROMPT, 3)),
    "unlikely draft": (SamplingParams(temperature=1.0), lambda: unlikeliest(DIST_PROMPT, 2)),
    "penalties, top-k, a repeated draft token": (
        SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.5, frequency_penalty=0.7),
        lambda: self_repeating(DISTRIBUTION_CASES["penalties, top-k, a repeated draft token"][0], 3)),
}


@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_verify_samples_the_non_speculative_distribution(case: str):
    params, draft = DISTRIBUTION_CASES[case]
    num_samples = 3000
    counts = first_two_tokens(params, draft(), num_samples)
    first = step_probs(DIST_PROMPT, params)
    expected = {(a, b): first[a].item() * p for a in range(DIST_VOCAB)
                for b, p in enumerate(step_probs(DIST_PROMPT + [a], params).tolist())}
    stat, dof = chi_square_pooled(counts, expected, num_samples)
    # Deterministic (fixed seeds); the bound is far in the tail (p ~ 1e-6) for these dof.
    assert stat < dof + 7 * math.sqrt(2 * dof)


# --------------------------------------------------------------------------------------
# Reproducibility, logprobs, failures
# --------------------------------------------------------------------------------------


def verify_once(requests: dict[int, SamplingParams], drafts: dict[int, list[int]], steps: int = 4):
    """``steps`` verify calls of a fresh sampler over ``requests`` (in that order); per request its
    tokens, logprobs and top logprobs."""
    sampler = make_sampler(requests, {r: [1, 2] for r in requests})
    out = {r: ([], [], []) for r in requests}
    for _ in range(steps):
        req_ids = list(requests)
        rows = [history_logits(r, [1, 2] + out[r][0] + drafts[r][:j], VOCAB)
                for r in req_ids for j in range(len(drafts[r]) + 1)]
        result = sampler.verify(on_device(torch.stack(rows) * 3), req_ids, [drafts[r] for r in req_ids])
        for n, r in enumerate(req_ids):
            out[r][0].extend(result.token_ids[n])
            out[r][1].extend(result.logprobs[n] or [])
            out[r][2].extend(result.top_logprobs[n] or [])
    return out


def test_same_seed_same_drafts_same_tokens_whatever_the_batch():
    seeded = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1, seed=1234, logprobs=2)
    others = {10: SamplingParams(temperature=0.0), 11: SamplingParams(temperature=1.3, seed=9), 12: SamplingParams()}
    drafts = {1: [5, 9, 5, 2], 10: [1, 2, 3], 11: [], 12: [7]}
    alone = verify_once({1: seeded}, drafts)[1]
    assert verify_once({1: seeded}, drafts)[1] == alone
    assert verify_once({10: others[10], 1: seeded, **others}, drafts)[1] == alone
    assert verify_once({**others, 1: seeded}, drafts)[1] == alone
    other_seed = SamplingParams(**{**vars(seeded), "seed": 4321})
    assert verify_once({1: other_seed}, drafts)[1][0] != alone[0]


def test_an_empty_draft_draws_what_sample_draws():
    requests = {r: SamplingParams(temperature=0.9, top_k=20, seed=r, logprobs=1) for r in range(6)}
    requests[6] = SamplingParams(temperature=0.0, presence_penalty=1.0)
    logits = random_logits(len(requests), VOCAB, seed=3)
    sampled = make_sampler(requests).sample(on_device(logits), list(requests))
    verified = make_sampler(requests).verify(on_device(logits), list(requests), [[]] * len(requests))
    assert verified.token_ids == [[t] for t in sampled.token_ids]
    assert verified.logprobs[:6] == [[lp] for lp in sampled.logprobs[:6]]
    assert verified.top_logprobs[:6] == [[top] for top in sampled.top_logprobs[:6]]


def test_logprobs_of_every_emitted_token_are_those_of_its_raw_row():
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0, logprobs=3)
    logits = random_logits(4, VOCAB, seed=2)
    draft = logits[:3].argmax(dim=-1).tolist()   # the raw argmax chain: the penalty may cut it
    result = make_sampler({0: params}, {0: [9]}).verify(on_device(logits), [0], [draft])
    raw = torch.log_softmax(logits, dim=-1)
    for row, (token_id, logprob, top) in enumerate(zip(result.token_ids[0], result.logprobs[0],
                                                       result.top_logprobs[0])):
        assert logprob == pytest.approx(raw[row, token_id].item(), abs=1e-6)
        assert [t for t, _ in top] == raw[row].topk(3).indices.tolist()


def test_a_request_that_breaks_the_step_fails_alone(grammar_compiler):
    regex = GuidedDecodingParams(regex="[0-9]{4}")
    requests = {0: SamplingParams(temperature=1.0, seed=1), 1: SamplingParams(temperature=0.0, guided_decoding=regex),
                2: SamplingParams(temperature=0.7, seed=2, guided_decoding=regex)}
    logits = random_logits(3 + 3 + 4, VOCAB, seed=4)
    # Request 1 (rows 3-5) drafts its greedy chain of digits, which it accepts whole, after the
    # matcher took it once in the failed attempt.
    drafts = [[4, 4], logits[3:5, :10].argmax(dim=-1).tolist(), [GRAMMAR_CHARS.index("3")] * 3]
    expected = grammar_sampler(grammar_compiler, requests).verify(on_device(logits), [0, 1, 2], drafts)

    broken = SamplingParams(temperature=1.0, seed=3)
    broken.top_k = 2**70   # past validation: no tensor holds it
    sampler = grammar_sampler(grammar_compiler, {**requests, 9: broken})
    got = sampler.verify(on_device(torch.cat([logits, logits[:1]])), [0, 1, 2, 9], [*drafts, []])
    assert got.token_ids[:3] == expected.token_ids and got.errors[:3] == [None] * 3
    assert got.token_ids[3] == [] and got.logprobs[3] is None and got.errors[3]
    assert len(got.token_ids[1]) == 3 and got.token_ids[1][-1] < 10, "the matcher was rolled back for the retry"


def test_a_draft_token_past_the_logits_is_rejected_and_removes_nothing():
    logits = random_logits(2, VOCAB, seed=6)
    logits[0, VOCAB - 1] += 40   # the clamp's stand-in for an id past the logits: removing it would show
    sampler = make_sampler({0: SamplingParams(temperature=1.0, seed=0), 1: SamplingParams(temperature=0.0)})
    result = sampler.verify(on_device(torch.cat([logits[:1], logits])), [0, 1], [[VOCAB + 5], []])
    assert result.token_ids == [[VOCAB - 1], [int(logits[1].argmax())]]
