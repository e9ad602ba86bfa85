"""Prompt-lookup drafts (``llmserve.engine.prompt_lookup``) against the seed's search, on random sequences."""

from __future__ import annotations

import random

import pytest

from llmserve.engine.prompt_lookup import PromptLookup


def seed_lookup(token_ids: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Seed 003's ``find_candidate_pred_tokens`` over a list, with its two bounds as this project
    states the rule: the continuation may be shorter than k (the seed asked for all k), and the
    matched n-gram may be any earlier occurrence but the suffix itself (the seed also skipped those
    that overlap the suffix)."""
    length = len(token_ids)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > length:
            continue
        ngram = token_ids[length - n :]
        for idx in range(length - n + 1):            # the seed's windows, in order
            if token_ids[idx : idx + n] == ngram:
                start, end = idx + n, min(idx + n + k, length)
                if start < end:
                    return token_ids[start:end]
    return []


@pytest.mark.parametrize("vocab", [2, 5, 50])
@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(1, 3), (2, 4), (1, 1)])
def test_propose_follows_the_seed_as_tokens_append(vocab, min_ngram, max_ngram):
    rng = random.Random(vocab * 100 + max_ngram)
    for _ in range(20):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        lookup = PromptLookup(prompt, min_ngram, max_ngram)
        seq = list(prompt)
        for _ in range(40):
            k = rng.randrange(0, 12)
            assert lookup.propose(k) == seed_lookup(seq, k, min_ngram, max_ngram) if k else lookup.propose(k) == []
            new = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 3, 70]))]   # 70: the bulk path
            lookup.extend(new)
            seq += new


def test_a_proposal_copies_what_followed_the_first_match():
    lookup = PromptLookup([7, 1, 2, 3, 4, 5, 9, 1, 2, 8, 1, 2])
    assert lookup.propose(3) == [3, 4, 5]       # "1 2" first occurs at 1; "8 1 2" does not recur
    assert lookup.propose(0) == []
    assert PromptLookup([1, 2, 3]).propose(4) == []   # nothing recurs
