"""Prompt-lookup drafts (seed 003): guess a request's next tokens from its own earlier tokens.

The rule: take the sequence's last ``n`` tokens, ``n`` from ``max_ngram`` down to ``min_ngram``;
find where that n-gram first occurs earlier in prompt + output (never the suffix matching
itself); the up to ``k`` tokens that followed it there are the draft. Input-grounded outputs
(summaries, answers quoted from a passage, edited code) copy long runs of their prompt, so the
model often agrees with the draft and a verify step emits several tokens for one forward.

The seed searches the whole sequence for every n at every step. Here each request keeps an
index from every n-gram it holds to the position where it first occurs, updated as tokens
append (``max_ngram - min_ngram + 1`` dict inserts per token), so a proposal costs a few dict
lookups however long the context is. Only the first occurrence matters: a later one has a
shorter continuation, and never a longer draft.
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookup:
    """One request's n-gram index over its tokens (prompt, then output as it grows)."""

    def __init__(self, token_ids: Sequence[int], min_ngram: int = 1, max_ngram: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.token_ids: list[int] = []
        # n-gram (a tuple of n ids; tuples of different n never collide) -> its first start
        self._first: dict[tuple[int, ...], int] = {}
        self._index_bulk(list(token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index tokens appended to the sequence."""
        if len(token_ids) > 64:
            self._index_bulk(list(token_ids))
            return
        tokens, first = self.token_ids, self._first
        for token in token_ids:
            tokens.append(token)
            end = len(tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                first.setdefault(tuple(tokens[end - n : end]), end - n)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow the sequence; [] when no n-gram of its end recurs."""
        tokens = self.token_ids
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            start = self._first.get(tuple(tokens[length - n :]))
            # start + n == length: the only occurrence is the suffix itself, which has nothing after it
            if start is not None and start + n < length:
                return tokens[start + n : start + n + k]
        return []

    def _index_bulk(self, token_ids: list[int]) -> None:
        """Index many appended tokens at once (a prompt): the n-grams are built by C loops
        (``zip``), and written last-to-first so that each key keeps its first position."""
        old = len(self.token_ids)
        self.token_ids.extend(token_ids)
        tokens = self.token_ids
        first = self._first
        for n in range(self.min_ngram, self.max_ngram + 1):
            begin = max(0, old - n + 1)      # n-grams ending in the new tokens only
            if len(tokens) - begin < n:
                continue
            grams = list(zip(*(tokens[begin + j : len(tokens) - n + 1 + j] for j in range(n))))
            new = dict(zip(reversed(grams), range(begin + len(grams) - 1, begin - 1, -1)))
            # The index's earlier entries are earlier positions: they win over the new ones.
            new.update((gram, first[gram]) for gram in new.keys() & first.keys())
            first.update(new)
