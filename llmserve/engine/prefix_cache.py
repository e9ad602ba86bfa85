"""The prefix cache's policy: which cached prefix a request starts from, what the tree keeps, and
what it gives up first.

With ``SchedulerConfig.prefix_cache`` on, a request is admitted with its longest cached prefix
already in place (``num_cached`` starts there; it locks the tree's path, radix_cache.py), and its
tokens join the tree when its prefill completes, when it is preempted and when it finishes. Slots
held = the tree's + the running requests' own (``num_cached - num_in_tree``). When the scheduler
needs room, the tree's entries that no running request uses are evicted, least recently used
first, before any request is preempted, and session pins (a conversation kept for its next turn)
are released, oldest first, before that too. Waiting requests are admitted longest cached prefix
first, within an age bound (``order``).

Every key the tree sees is made by ``key``: what must never share KV must differ there (an
image's placeholders are keyed by its pixels, a LoRA adapter's requests by the adapter).
"""

from __future__ import annotations

from collections import deque

from llmserve.engine.radix_cache import Node, RadixCache
from llmserve.engine.request import Request

# Cache-aware ordering looks at this many waiting requests at most (the rest wait in arrival
# order): matching costs a walk of the tree per request and step.
MAX_RANKED_WAITING = 128


class PrefixCacheManager:
    def __init__(self, enabled: bool, wait_steps: int = 64, image_token_id: int | None = None,
                 tokens_per_image: int = 0) -> None:
        # Off, the tree stays empty: nothing matches, so no request holds a node or adds to it.
        self.enabled = enabled
        self.tree = RadixCache()
        # A fresh request that has waited this many steps goes before every younger one (``order``).
        self.wait_steps = wait_steps
        # How prompts with images are keyed (``Request.cache_key``); None: a text-only model.
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        # session id -> the node its pin holds, oldest pin first (released first under pressure)
        self.sessions: dict[str, Node] = {}
        # Since start, for /metrics: tokens looked up at admission, and found.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self._num_steps = 0
        self._queued_at: dict[Request, int] = {}    # waiting fresh requests -> the step they arrived at

    def key(self, req: Request, n: int) -> list[int]:
        """The request's first ``n`` tokens as the tree keys them. A request with a LoRA adapter
        has its first token keyed as (adapter, token): the adapter changes every layer's K and V,
        so its prefixes live in a subtree of their own, which no other adapter (nor the base model)
        reaches. The key stays one entry per token (the tree's depth counts slots)."""
        key = req.cache_key(n, self.image_token_id, self.tokens_per_image)
        if req.lora_id and key:
            key[0] = (req.lora_id, key[0])
        return key

    # -- the waiting queue -----------------------------------------------------------------
    def queued(self, req: Request) -> None:
        self._queued_at[req] = self._num_steps

    def order(self, waiting: deque[Request]) -> deque[Request]:
        """The waiting queue in cache-aware admission order (SGLang's longest-prefix-match, with
        an age bound), called once a step: the preempted requests stay first, in their order; then
        the fresh ones that have waited ``wait_steps`` steps, oldest first; then the others,
        longest cached prefix first (arrival order among equals)."""
        self._num_steps += 1
        if self.tree.num_tokens == 0 or len(waiting) < 2:
            return waiting
        queue = list(waiting)
        first_fresh = next((i for i, r in enumerate(queue) if r.first_scheduled_time is None), len(queue))
        fresh = queue[first_fresh : first_fresh + MAX_RANKED_WAITING]
        if len(fresh) < 2:
            return waiting

        def rank(req: Request) -> tuple:
            if self._num_steps - self._queued_at.get(req, self._num_steps) >= self.wait_steps:
                return (0, 0, req.arrival_time)
            n = 0 if req.needs_prompt_logprobs else self.tree.prefix_length(self.key(req, req.num_tokens - 1))
            return (1, -n, req.arrival_time)

        fresh.sort(key=rank)
        return deque(queue[:first_fresh] + fresh + queue[first_fresh + len(fresh):])

    # -- a request's hold on the tree ------------------------------------------------------
    def match(self, req: Request) -> int:
        """Lock the request's longest cached prefix (its node: ``req.cache_node``) and return its
        length; 0 with the cache off. At least the last token stays uncached: its logits sample
        the next one. A request that wants prompt logprobs needs every prompt row computed: it
        matches nothing."""
        if not self.enabled:
            return 0
        if req.needs_prompt_logprobs:
            node, n = self.tree.root, 0
        else:
            node, n = self.tree.match(self.key(req, req.num_tokens - 1))
        self.tree.lock(node)
        req.cache_node, req.num_in_tree = node, n
        return n

    def admitted(self, req: Request) -> None:
        """The request ``match`` locked a prefix for is admitted: it starts from that prefix."""
        self._queued_at.pop(req, None)
        if req.cache_node is not None:
            req.num_cached_prefix = req.num_in_tree
            self.num_queried_tokens += req.num_tokens
            self.num_hit_tokens += req.num_in_tree

    def insert(self, req: Request, n: int) -> None:
        """A step that fed the request's first ``n`` tokens is done (its prefill is complete): put
        them in the tree now, so that requests arriving while it decodes share them."""
        if req.cache_node is None:
            return
        node, added = self.tree.insert(self.key(req, n), req.req_id)
        if node is not req.cache_node:   # the lock moves down to the new deepest node
            self.tree.lock(node)
            self.tree.unlock(req.cache_node)
            req.cache_node = node
        req.num_in_tree += added

    def leave(self, req: Request, keep: bool, upto: int | None = None) -> None:
        """The request stops using the tree (it finished, was preempted or retired): with
        ``keep``, its computed tokens (at most ``upto``, what it fed, and what it knows: never a
        token in flight) go in first, and a session's request pins them for the session's next
        turn."""
        self._queued_at.pop(req, None)      # (one that finished while waiting)
        if req.cache_node is None:
            return
        if keep:
            n = min(req.num_cached, req.num_tokens, req.num_cached if upto is None else upto)
            if n > self.tree.depth(req.cache_node):
                self.insert(req, n)
            if req.session_id is not None:
                self._pin(req.session_id, req.cache_node)
        self.release(req)

    def release(self, req: Request) -> None:
        """Unlock the request's cached prefix (``match``), keeping nothing of its own."""
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
            req.cache_node, req.num_in_tree = None, 0

    # -- sessions and eviction -------------------------------------------------------------
    def _pin(self, session_id: str, node: Node) -> None:
        """Hold the session's conversation in the tree, in place of its previous turn's pin."""
        old = self.sessions.pop(session_id, None)
        self.tree.pin(node)
        if old is not None:
            self.tree.unpin(old)
        self.sessions[session_id] = node

    def end_session(self, session_id: str) -> None:
        """Unpin the session's conversation and free the tokens only it held: no request will
        send that conversation again (as LMDeploy frees a session at its end). A prefix it shares
        with other entries (a common system prompt, the same question asked elsewhere) stays."""
        node = self.sessions.pop(session_id, None)
        if node is not None:
            self.tree.discard(node)

    @property
    def num_reclaimable_tokens(self) -> int:
        """Slots ``make_room`` could free: the tree's that no running request uses (evictable, and
        a session's pinned ones)."""
        return self.tree.num_evictable_tokens + self.tree.num_pinned_tokens

    def make_room(self, num_slots: int) -> None:
        """Evict the tree's least recently used entries until ``num_slots`` more slots are free,
        or nothing unused is left; then release session pins, oldest first, and evict again.
        (Pins are soft: the session's next turn just prefills more.)"""
        if num_slots <= 0:
            return
        freed = self.tree.evict(num_slots)
        while freed < num_slots and self.sessions:
            oldest = next(iter(self.sessions))
            self.tree.unpin(self.sessions.pop(oldest))
            freed += self.tree.evict(num_slots - freed)

    def evict_all(self) -> int:
        """Evict every entry that no running request uses (session pins too); the slots freed."""
        for node in self.sessions.values():
            self.tree.unpin(node)
        self.sessions.clear()
        return self.tree.evict(self.tree.num_tokens)
