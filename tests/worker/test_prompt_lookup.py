"""Prompt-lookup drafts (``llmserve.worker.prompt_lookup``) against a plain search of the same rule,
on random sequences as tokens append."""

from __future__ import annotations

import random

import pytest

from llmserve.worker.prompt_lookup import CANDIDATES, DRAFT_PER_MATCHED_TOKEN, MAX_MATCH, Draft, PromptLookup


def reference(token_ids: list[int], k: int, min_ngram: int, max_ngram: int) -> Draft:
    """The rule, searched the slow way: the seed's n from max_ngram down to min_ngram (the first n
    whose last n tokens occur earlier); of that n-gram's CANDIDATES latest earlier occurrences, the
    one whose agreement with the sequence's end reaches furthest back (at most MAX_MATCH tokens;
    the latest among equals); its continuation, DRAFT_PER_MATCHED_TOKEN tokens per agreeing token,
    at most k, copied on past the sequence's end as if the copy wrote there."""
    length = len(token_ids)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= length:
            continue
        ngram = token_ids[length - n :]
        starts = [i for i in range(length - n) if token_ids[i : i + n] == ngram][::-1][:CANDIDATES]
        if not starts:
            continue

        def agreement(i: int) -> int:
            m = 0
            while m < MAX_MATCH and i + n - 1 - m >= 0 and token_ids[i + n - 1 - m] == token_ids[length - 1 - m]:
                m += 1
            return m

        best = max(starts, key=lambda i: (agreement(i), i))
        size = min(k, DRAFT_PER_MATCHED_TOKEN * agreement(best))
        extended = list(token_ids)
        for i in range(size):          # copying on as if writing at the end: may copy the copy
            extended.append(extended[best + n + i])
        return Draft(extended[length:], agreement(best))
    return Draft([])


@pytest.mark.parametrize("vocab", [2, 5, 50])
@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(1, 3), (2, 4), (1, 1)])
def test_propose_follows_the_rule_as_tokens_append(vocab, min_ngram, max_ngram):
    rng = random.Random(vocab * 100 + max_ngram)
    for _ in range(20):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        lookup = PromptLookup(prompt, min_ngram, max_ngram)
        seq = list(prompt)
        for _ in range(40):
            k = rng.randrange(0, 12)
            assert lookup.propose(k) == (reference(seq, k, min_ngram, max_ngram) if k else Draft([]))
            full = reference(seq, 1, min_ngram, max_ngram).match_len
            assert lookup.match_len() == full and lookup.match_len(at_most=3) == min(full, 3)   # rank 0's report
            new = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 3, 70]))]
            lookup.extend(new)
            seq += new


def test_a_copy_under_way_continues_where_it_is():
    """The output copies the second of two lines that share "1 2 3": the draft continues the second
    (the longer match), not the first line (the seed's first occurrence)."""
    first, second = [1, 2, 3, 4, 5, 6, 7, 8], [9, 1, 2, 3, 11, 12, 13, 14, 15, 16]
    lookup = PromptLookup(first + second + [0, 9, 1, 2, 3])
    assert lookup.propose(10) == Draft([11, 12, 13, 14, 15, 16, 0, 9], 4)   # 8: 2 per matched token
    lookup = PromptLookup(first + second + [8, 9, 1, 2, 3])
    assert lookup.propose(10) == Draft([11, 12, 13, 14, 15, 16, 8, 9, 1, 2], 5)


def test_a_weak_match_gets_a_short_draft():
    lookup = PromptLookup([5, 1, 2, 3, 4, 5, 6, 7, 9, 1])   # only "1" recurs
    assert lookup.propose(10) == Draft([2, 3], 1)
    assert lookup.propose(1) == Draft([2], 1)
    assert lookup.propose(0) == Draft([])
    assert PromptLookup([1, 2, 3]).propose(4) == Draft([])   # nothing recurs
    assert PromptLookup([]).propose(4) == Draft([])


def test_the_latest_of_equal_matches_wins_and_only_candidates_are_looked_at():
    # "1" occurs at 0 and 2, each a 1-token match: the latest, at 2, is continued
    assert PromptLookup([1, 9, 1, 8, 1]).propose(2).token_ids == [8, 1]


def test_a_copy_that_reaches_the_end_copies_itself():
    assert PromptLookup([7] * 5).propose(4) == Draft([7] * 4, 4)            # a run of one token
    assert PromptLookup([5, 1, 2, 3, 1, 2, 3]).propose(8) == Draft([1, 2, 3, 1, 2, 3], 3)   # a loop; 6 = 2 x 3
    # A long match older than CANDIDATES later occurrences of its n-gram is not seen.
    old = [40, 41, 42, 1, 2, 3, 4]
    noise = [tok for i in range(CANDIDATES) for tok in (50 + i, 1, 2, 3, 60 + i)]
    lookup = PromptLookup(old + noise + [41, 42, 1, 2, 3])
    assert lookup.propose(10) == Draft([60 + CANDIDATES - 1, 41, 42, 1, 2, 3], 3)
    lookup = PromptLookup(old + noise[5:] + [41, 42, 1, 2, 3])        # one fewer: now it is
    assert lookup.propose(10) == Draft([4, *noise[5:14]], 5)
