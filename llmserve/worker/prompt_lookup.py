"""Prompt-lookup drafts (seed 003): guess a request's next tokens from its own earlier tokens.

The seed's rule: take the sequence's last ``n`` tokens, ``n`` from ``max_ngram`` down to
``min_ngram``; find where that n-gram occurs earlier in prompt + output (never the suffix matching
itself); the up to ``k`` tokens that followed it there are the draft. Input-grounded outputs
(summaries, answers quoted from a passage, edited code) copy long runs of their prompt, so the
model often agrees with the draft and a verify step emits several tokens for one forward.

The seed leaves two questions open ("what to do when there are multiple matches? What's the
ideal length of continuation?"). Our answers, chosen by replaying the embedded model's greedy
code edits under each rule and then measured in the engine (benchmarks/README.md,
"prompt_lookup.py"):

- **Which occurrence.** Of the ``CANDIDATES`` latest occurrences of the longest recurring n-gram,
  the one whose match reaches furthest back: the tokens before the n-gram agree too, up to
  ``MAX_MATCH`` in all (the latest among equals). A copy under way (the output has been
  reproducing a passage) then continues from where it is in the passage, not from the first
  line that happens to share the last three tokens.
- **How long a draft.** ``DRAFT_PER_MATCHED_TOKEN`` tokens per matched token, at most ``k``: a
  lone recurring token (a space, a comma) is weak evidence and gets a 2-token draft, a match of 5
  tokens or more the whole ``k`` = 10. A rejected draft token costs a row of the verify step (on
  a CPU about 6-8% of a decode step each), so short guesses for weak matches pay.
- A copy that reaches the sequence's end goes on copying itself (``_copy``): the latest
  occurrence is often a loop in the output, or a run of one token.

On the four code edits at batch 1 (256 tokens, CPU) tokens per forward went from 2.04, 3.15,
1.68, 2.71 (the seed's rule, as of 1fea7fa) to 2.63, 3.49, 1.82, 3.07.

Each request keeps, per n, a map from every n-gram it holds to its latest start, and for every
start the previous start of the same n-gram (a chain, newest first), updated as tokens append
(``max_ngram - min_ngram + 1`` dict updates per token). A proposal walks at most ``CANDIDATES``
links and compares at most ``MAX_MATCH`` tokens for each: microseconds however long the context.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

# Occurrences of the n-gram looked at, latest first.
CANDIDATES = 8
# The longest match measured (tokens agreeing backwards from the sequence's end, the n-gram's
# included): beyond it, occurrences tie, and the latest wins.
MAX_MATCH = 32
# Draft tokens per matched token (at most k): 2 for a lone token, k from 5 on at k = 10.
DRAFT_PER_MATCHED_TOKEN = 2
# A match this long says a copy is under way (a passage, or a loop of the output): the engine ends
# a request's drafting back-off on it (engine/drafting.py), and rank 0 reports each request's match
# after every step counted up to it.
LONG_MATCH = 4


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    # Tokens of the sequence's end that agree with the occurrence the draft continues (>= n): how
    # much evidence it has. The back-off (drafting.py) counts only rejected drafts with matches of 2+.
    match_len: int = 0


class PromptLookup:
    """One request's n-gram index over its tokens (prompt, then output as it grows)."""

    def __init__(self, token_ids: Sequence[int], min_ngram: int = 1, max_ngram: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.token_ids: list[int] = []
        # Per n (index n - min_ngram): n-gram (a tuple of n ids) -> its latest start, and per start
        # i, the start of the previous occurrence of the n-gram at i (-1: none; 8 bytes an entry,
        # where a list would hold an int object of 28 bytes for most of them).
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_ngram, max_ngram + 1)]
        self._previous: list[array] = [array("q") for _ in range(min_ngram, max_ngram + 1)]
        self.extend(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index tokens appended to the sequence: every n-gram that ends in them."""
        tokens = self.token_ids
        tokens.extend(token_ids)
        for n, latest, previous in zip(range(self.min_ngram, self.max_ngram + 1), self._latest, self._previous):
            begin = len(previous)                        # the first start not indexed yet
            stop = len(tokens) - n + 1                   # one past the last start with n tokens
            if stop <= begin:
                continue
            grams = zip(*(tokens[begin + j : stop + j] for j in range(n)))   # built by C loops
            get, add = latest.get, previous.append
            for start, gram in enumerate(grams, begin):
                add(get(gram, -1))
                latest[gram] = start

    def propose(self, k: int) -> Draft:
        """A draft of up to ``k`` tokens to follow the sequence (see the module's doc); an empty one
        when no n-gram of its end recurs."""
        if k <= 0:
            return Draft([])
        start, match_len = self._best_match()
        if start < 0:
            return Draft([])
        return Draft(_copy(self.token_ids, start, min(k, DRAFT_PER_MATCHED_TOKEN * match_len)), match_len)

    def match_len(self, at_most: int = MAX_MATCH) -> int:
        """The match a draft proposed now would continue (`Draft.match_len`), counted up to
        ``at_most``: 0 when no n-gram of the sequence's end recurs. About a microsecond at
        ``at_most`` = LONG_MATCH, the engine's question (whether a copy is under way): most ends of
        free text have no recurring n-gram of ``max_ngram`` tokens, and in a copy the first
        occurrence looked at answers it (the whole walk, at MAX_MATCH, took 21 us in a loop)."""
        return min(self._best_match(at_most)[1], at_most)

    def _best_match(self, at_most: int = MAX_MATCH) -> tuple[int, int]:
        """Where the draft starts (the token after the chosen occurrence of the longest recurring
        n-gram), and its match length counted up to ``at_most`` (the first occurrence that
        reaches it wins, as the latest of equals does); (-1, 0) when no n-gram of the end recurs."""
        tokens = self.token_ids
        length = len(tokens)
        longest = min(MAX_MATCH, at_most)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            previous = self._previous[n - self.min_ngram]
            # The n-gram's latest occurrence is the suffix itself (nothing follows it): start before it.
            start = previous[length - n]
            best, best_len = -1, 0
            for _ in range(CANDIDATES):
                if start < 0 or best_len >= longest:
                    break
                match_len = n      # and back from there while the tokens before both agree
                while (match_len < longest and start - 1 - (match_len - n) >= 0
                       and tokens[start - 1 - (match_len - n)] == tokens[length - 1 - match_len]):
                    match_len += 1
                if match_len > best_len:
                    best, best_len = start, match_len
                start = previous[start]
            if best >= 0:
                return best + n, best_len
        return -1, 0


def _copy(tokens: list[int], start: int, size: int) -> list[int]:
    """``size`` tokens copied from ``start`` on, as if the copy went on writing at the sequence's
    end (an overlapping copy, LZ77's): where the source reaches the end, it continues with the
    copy's own first tokens. A latest occurrence is often near the end (a loop in the output, a run
    of one token), and the seed's cut at the end would leave its draft a token or two."""
    draft = tokens[start : start + size]
    for i in range(len(draft), size):
        draft.append(draft[i - (len(tokens) - start)])
    return draft
