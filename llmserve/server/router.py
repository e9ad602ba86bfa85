"""Which data-parallel replica runs a request (``llmserve serve --dp N``): SGLang's cache-aware
routing, approximated in the HTTP process.

The router cannot see the replicas' prefix caches (each engine core keeps its own tree). It
remembers instead, per replica, the prompts it sent there lately: each prompt as the hashes of its
whole blocks of ``BLOCK_TOKENS`` tokens, each block's hash chained from the one before (so a hash
names the whole prefix up to its block's end: a path of a tree). A replica remembers at most as
many blocks as its KV cache has slots for, the least recently used forgotten first, as its own
cache evicts. A request's LoRA adapter seeds its chain: an adapter's prefixes never match the
base model's (the engine's prefix cache keeps them apart too).

The rule, in order:

1. A turn of an interactive session goes where the session's first turn went: its conversation
   is pinned in that replica's cache.
2. The replica remembering the longest prefix of the prompt (whole blocks; the least loaded one
   among equals), unless it has more than ``max_imbalance`` requests in flight beyond the least
   loaded replica: then a hot prefix spreads to a second replica rather than queueing on one.
3. Otherwise (nothing matches, or the match is too busy): the least loaded replica (fewest
   requests in flight), the lowest index among equals.

The caller gives the loads (requests in flight per replica) with each request; the router keeps
only what it remembers of prompts and sessions. It runs on the HTTP process's event loop, so
nothing here is shared between threads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK_TOKENS = 16
# Requests in flight a replica holding the longest match may have beyond the least loaded one
# and still get the request (SGLang's balance_abs_threshold plays this part).
MAX_IMBALANCE = 16


class CacheAwareRouter:
    def __init__(self, num_replicas: int, capacity_tokens: int, block_tokens: int = BLOCK_TOKENS,
                 max_imbalance: int = MAX_IMBALANCE):
        """``capacity_tokens``: one replica's KV cache, the most it can remember."""
        self.block_tokens = block_tokens
        self.max_imbalance = max_imbalance
        self.capacity_blocks = max(1, capacity_tokens // block_tokens)
        # per replica: chained block hash -> None, least recently used first
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._sessions: dict[str, int] = {}     # session id -> its replica

    def route(self, prompt: Sequence[int], loads: Sequence[int], session_id: str | None = None,
              lora_name: str | None = None) -> int:
        """The replica for a request with this prompt; it remembers the prompt from now on."""
        hashes = self._chain(prompt, lora_name)
        if session_id is not None and session_id in self._sessions:
            replica = self._sessions[session_id]
        else:
            replica = self._choose(hashes, loads)
            if session_id is not None:
                self._sessions[session_id] = replica
        self._remember(replica, hashes)
        return replica

    def end_session(self, session_id: str) -> int | None:
        """Forget the session; the replica it ran on (None: the router never saw it)."""
        return self._sessions.pop(session_id, None)

    def match_length(self, replica: int, prompt: Sequence[int], lora_name: str | None = None) -> int:
        """Tokens of the prompt's start that ``replica`` is remembered to hold."""
        return self._matched_blocks(replica, self._chain(prompt, lora_name)) * self.block_tokens

    # -- the rule --------------------------------------------------------------------------
    def _choose(self, hashes: list[int], loads: Sequence[int]) -> int:
        replicas = range(len(self._blocks))
        least_load = min(loads)
        matched = [self._matched_blocks(r, hashes) for r in replicas]
        best = max(replicas, key=lambda r: (matched[r], -loads[r], -r))
        if matched[best] > 0 and loads[best] - least_load <= self.max_imbalance:
            return best
        return min(replicas, key=lambda r: (loads[r], r))

    def _matched_blocks(self, replica: int, hashes: list[int]) -> int:
        blocks = self._blocks[replica]
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        return n

    # -- memory ----------------------------------------------------------------------------
    def _chain(self, prompt: Sequence[int], lora_name: str | None) -> list[int]:
        """The chained hashes of the prompt's whole blocks."""
        b = self.block_tokens
        h = hash(lora_name)
        hashes = []
        for start in range(0, len(prompt) - b + 1, b):
            h = hash((h, tuple(prompt[start : start + b])))
            hashes.append(h)
        return hashes

    def _remember(self, replica: int, hashes: list[int]) -> None:
        # Deepest block first, so the prompt's first block is the most recently used: forgetting
        # starts at the ends of prefixes, never cutting a chain in the middle.
        blocks = self._blocks[replica]
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
