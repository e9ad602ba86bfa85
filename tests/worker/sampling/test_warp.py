"""Choosing the token (sampling/warp.py): top-k / top-p, typical-p, HF's warper order, and the
distribution of the draws."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

import llmserve.worker.sampling.warp as warp_module
from llmserve.sampling_params import SamplingParams
from sampler_test_utils import VOCAB, make_sampler, random_logits


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
    monkeypatch.setattr(warp_module, "TOP_CANDIDATES", 64)
    vocab_size = 2000
    top_k = torch.tensor([0, 5, 64, 65, 1500, 0, 0, 0, 3, 0, 0, 100] * 6)
    top_p = torch.tensor([0.9, 1.0, 0.95, 1.0, 1.0, 0.5, 0.99, 1.0, 0.7, 0.999, 0.1, 0.8] * 6)
    logits = random_logits(len(top_k), vocab_size, seed=12)
    logits[:24] *= 0.1          # flat rows: nuclei wider than the candidates
    logits[48:, :20] += 20      # peaked rows: nuclei of a few tokens
    sorted_rows: list[int] = []
    whole_sort = warp_module._sort_top_k_top_p

    def spy(rows: torch.Tensor, *args) -> torch.Tensor:
        sorted_rows.append(len(rows))
        return whole_sort(rows, *args)

    monkeypatch.setattr(warp_module, "_sort_top_k_top_p", spy)
    got = warp_module._apply_top_k_top_p(logits, top_k, top_p)
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
    got = warp_module._apply_typical_p(logits, typical_p)
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
    got = warp_module.warp(logits, [sampler._requests[i] for i in range(len(params))])
    for row, p in enumerate(params):
        torch.testing.assert_close(got[row], hf_warped(logits[row], p))


def test_typical_p_never_picks_excluded_tokens():
    logits = random_logits(VOCAB, seed=8)
    allowed = set((~hf_warped(logits, SamplingParams(typical_p=0.4)).isinf()).nonzero().flatten().tolist())
    assert 1 < len(allowed) < VOCAB
    counts = sample_many(logits, lambda i: SamplingParams(typical_p=0.4, seed=i), num_samples=2000)
    assert set(counts) == allowed
