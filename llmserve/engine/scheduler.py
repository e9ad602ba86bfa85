"""Continuous batching: which requests take part in the next forward pass.

Each step mixes decodes and prefills in one batch. The running requests that are decoding all
go: each feeds the token it sampled last step. If the KV pool cannot hold those tokens, the
newest running requests are preempted (their cache is dropped; they are prefilled again later,
ahead of every newer arrival). Then prefills fill the step's prefill budget
(``max_prefill_tokens``): first the prompts already under way, then waiting requests in arrival
order. A prompt longer than what is left of the budget is split over several steps (chunked
prefill), so a burst of long prompts never stalls the running decodes for more than one
budget's worth of compute; the request samples its first token with its last chunk. The
scheduler only does the bookkeeping; the engine runs the step and tells it what happened
(``update_after_step``, ``finish_request``).

KV accounting is in token slots: a request holds ``num_cached`` slots. A step that feeds ``n``
new tokens of a request needs ``n`` free slots. Admitting a request reserves room for its whole
prompt at once, so a prefill that has started can always finish.

With the overlapped loop the engine schedules a step before it has read the tokens of the step
still running: a request's tokens then include the one in flight (``num_pending_tokens``), which
its decode feeds like any other. A request whose final token (``max_new_tokens``) is in flight
is retired at once (``retire``): the batches are then the plain loop's, step for step.

Speculation (``speculate`` > 0): a decoding request whose tokens are all known (none in flight)
may bring a prompt-lookup draft (``prompt_lookup.py``) after its sampled token, so that one
forward verifies them all. Drafts come last, from what the step leaves: the prefill budget's
rest, and the KV slots left once the prompts under way and one next decode per running request
are provided for; a draft is shortened or dropped when room is short, so it never causes a
preemption. (Constrained requests draft too: the verifier judges each draft token in the grammar's
state after the ones before it.) A draft never takes a request past ``max_new_tokens`` (at most
``max_new_tokens - num_output - 1`` tokens, the verify step's own token being the last). Batches
of more than ``speculate_max_batch`` decodes take no drafts: there, verifying costs the device
more than the accepted tokens save. A request whose drafts keep gaining nothing (no n-gram of its
end recurs, or the model accepts none of a well-matched draft) backs off: see ``draft_verified``.
With the prefix cache (``SchedulerConfig.prefix_cache``, radix_cache.py) a request is admitted
with its longest cached prefix already in place (``num_cached`` starts there; it locks the tree's
path), and its tokens join the tree when its prefill completes, when it is preempted and when it
finishes. Slots held = the tree's + the running requests' own (``num_cached - num_in_tree``); the
tree's entries that no running request uses are evicted, least recently used first, before any
request is preempted, and session pins are released, oldest first, before that too.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from llmserve.engine.prompt_lookup import PromptLookup
from llmserve.engine.radix_cache import Node, RadixCache
from llmserve.engine.request import FinishReason, Request, RequestStatus


# The most decode steps a request whose drafts gain nothing sits out between two lookups.
_MAX_DRAFT_WAIT = 15


@dataclass
class SchedulerConfig:
    max_total_token_num: int  # KV pool size in token slots
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192  # prompt tokens per step
    # Split prompts over steps to stay within max_prefill_tokens. Off: a prompt runs whole, and
    # one larger than the budget runs alone.
    chunked_prefill: bool = True
    # Draft tokens per decoding request per step, from prompt lookup; 0: no speculation.
    speculate: int = 0
    # More decodes than this in a step: no drafts (verifying a large batch costs more than it saves).
    speculate_max_batch: int = 32
    prompt_lookup_min_ngram: int = 1
    prompt_lookup_max_ngram: int = 3
    # Keep requests' tokens in a radix tree (radix_cache.py) and start each request from its
    # longest cached prefix. (The engine's default is on; bare schedulers in tests run without.)
    prefix_cache: bool = False
    # Cache-aware admission: waiting requests with longer cached prefixes go first, but one that
    # has waited this many steps goes before every younger one (no starvation).
    prefix_wait_steps: int = 64
    # How prompts with images are keyed (Request.cache_key); None: a text-only model.
    image_token_id: int | None = None
    tokens_per_image: int = 0


# Cache-aware ordering looks at this many waiting requests at most (the rest wait in arrival
# order): matching costs a walk of the tree per request and step.
_MAX_RANKED_WAITING = 128


@dataclass
class ScheduledRequest:
    request: Request
    # Feed all_token_ids[num_cached : num_cached + num_new_tokens] this step.
    num_new_tokens: int
    # The step reaches the end of the request's tokens, so it samples the next one (false for
    # every chunk of a split prompt but the last).
    samples: bool = True
    # A decode's draft: fed after its sampled token (they are part of num_new_tokens), verified
    # by the step's sampler, which keeps the prefix the model agrees with.
    draft_token_ids: list[int] = field(default_factory=list)
    # How many of the request's last tokens agree with the text the draft was copied from (see
    # prompt_lookup.Draft): the back-off's evidence (``Scheduler.draft_verified``).
    draft_match_len: int = 0
    # A chunk of a prompt (or of a preempted request's tokens), not a decode: the step that
    # samples after one completes a prefill, whose tokens then join the prefix cache.
    prefill: bool = False


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Requests taken out of the running batch: the workers must free their KV cache
    # before running this step.
    preempted: list[Request]
    # What the step feeds: one token per decoding request, and prompt tokens (for /metrics,
    # the periodic log line and the step trace).
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens + self.num_draft_tokens

    @property
    def has_drafts(self) -> bool:
        return self.num_draft_tokens > 0


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0     # since start, for /metrics
        self.cache = RadixCache() if config.prefix_cache else None
        # session id -> the node its pin holds, oldest pin first (released first under pressure)
        self.sessions: dict[str, Node] = {}
        # Since start, for /metrics: tokens looked up in the cache at admission, and found.
        self.num_cache_queried_tokens = 0
        self.num_cache_hit_tokens = 0
        self._num_steps = 0
        self._queued_at: dict[Request, int] = {}    # waiting fresh requests -> the step they arrived at

    # ----------------------------------------------------------------------------------
    # Requests in and out
    # ----------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        # Admitted by check_request (engine/admission.py), whose limits are within the KV pool's.
        assert req.num_prompt_tokens > 0, req.req_id
        assert req.num_prompt_tokens + req.params.max_new_tokens <= self.config.max_total_token_num, req.req_id
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self._queued_at[req] = self._num_steps

    def finish_request(self, req: Request, reason: FinishReason) -> None:
        """Drop a request; its KV slots count as free from now on."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
            self._queued_at.pop(req, None)
        # What it fed, bar its last token: the plain loop never feeds that one (the overlapped one
        # may have), and both must leave the same tree.
        self.leave_cache(req, keep=reason is not FinishReason.ERROR, upto=req.num_tokens - 1)
        req.finish(reason)

    def retire(self, req: Request) -> bool:
        """Take out of the running batch a request with nothing left to schedule (its final token
        is in flight): its KV slots count as free from now on, as the workers free them before
        the next step. It finishes when that token is read (``finish_request``). False if it was
        not running (retired already: a step of it failed and ran again)."""
        if req not in self.running:
            return False
        self.running.remove(req)
        return True

    def abort_request(self, req_id: int) -> Request | None:
        """Finish an unfinished request with ABORT; None if there is no such request."""
        for req in [*self.running, *self.waiting]:
            if req.req_id == req_id:
                self.finish_request(req, FinishReason.ABORT)
                return req
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------------------------
    # One step
    # ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._num_steps += 1
        preempted = self._preempt_until_decodes_fit()
        # (A prompt whose last chunk is one token looks like a decode: it is that prompt's prefill.)
        scheduled = [ScheduledRequest(req, 1, prefill=req.num_output_tokens == 0 and not req.num_pending_tokens)
                     for req in self.running if self.is_decoding(req)]
        num_decodes = len(scheduled)
        budget = _PrefillBudget(self.config.max_prefill_tokens)
        for req in self.running:   # prompts under way first: they are older than any waiting one
            if not self.is_decoding(req):
                chunk = self._chunk(req, budget)
                if chunk == 0:
                    break
                scheduled.append(self._scheduled(req, chunk))
        scheduled += self._admit_waiting(budget)
        num_drafts = self._add_drafts(scheduled[:num_decodes], budget.left)
        return SchedulerOutput(scheduled, preempted, num_decodes, budget.taken, num_drafts)

    def drafting(self) -> bool:
        """Whether the next step may carry drafts (speculation is on and the batch is small enough).
        The engine then runs it without look-ahead: a draft continues tokens it must have read."""
        return (0 < self.config.speculate and 0 < len(self.running) <= self.config.speculate_max_batch
                and any(self._draftable(req) and not req.draft_wait for req in self.running))

    def _add_drafts(self, decodes: list[ScheduledRequest], token_budget: int) -> int:
        """Give the step's decodes their drafts, within ``token_budget`` and the KV slots to spare;
        returns how many draft tokens they took."""
        if not self.config.speculate or len(decodes) > self.config.speculate_max_batch:
            return 0
        # One slot per running request stays free for its next decode: a draft never forces a preemption.
        room = min(token_budget, self._num_uncommitted_slots() - len(decodes) - len(self.running))
        total = 0
        for s in decodes:
            req = s.request
            if room <= 0:
                break
            if req.draft_wait:
                req.draft_wait -= 1
                continue
            if not self._may_draft(req):
                continue
            k = min(self.config.speculate, req.params.max_new_tokens - req.num_output_tokens - 1, room)
            draft = self._prompt_lookup(req).propose(k)
            if not draft.token_ids and k > 0:
                self._draft_missed(req)
            s.draft_token_ids, s.draft_match_len = draft.token_ids, draft.match_len
            s.num_new_tokens += len(draft.token_ids)
            room -= len(draft.token_ids)
            total += len(draft.token_ids)
        return total

    @staticmethod
    def _draftable(req: Request) -> bool:
        return req.params.speculate

    def _may_draft(self, req: Request) -> bool:
        # A token in flight (overlapped step) is not known yet: nothing can continue it.
        return self._draftable(req) and req.num_pending_tokens == 0

    def draft_verified(self, s: ScheduledRequest, num_accepted: int) -> None:
        """The step verified ``s``'s draft and kept ``num_accepted`` of its tokens. The back-off's
        rules, in order:

        1. A draft with any token accepted puts the request back to drafting every step
           (``num_draft_misses`` = 0).
        2. A draft rejected whole is a miss (``_draft_missed``) if its match was 2 tokens or more.
           One that continued a lone recurring token is a guess of 2 tokens at most (see
           prompt_lookup.py), cheap to verify and often wrong: it costs the request nothing here.
        3. A lookup that finds nothing is a miss too (``_add_drafts``).

        From the second miss in a row the request sits out 1, 3, 7, then 15 decode steps
        (``draft_wait``) before it looks for a draft again. An answer that copies nothing then costs
        a lookup every 16 steps rather than a verify step (on a GPU also a step without the
        overlapped loop's look-ahead) every step, while one that copies in runs keeps drafting."""
        if num_accepted:
            s.request.num_draft_misses = 0
        elif s.draft_match_len >= 2:
            self._draft_missed(s.request)

    @staticmethod
    def _draft_missed(req: Request) -> None:
        req.num_draft_misses += 1
        req.draft_wait = min(2 ** (req.num_draft_misses - 1), _MAX_DRAFT_WAIT + 1) - 1

    def _prompt_lookup(self, req: Request) -> PromptLookup:
        """The request's n-gram index, made on its first draft and brought up to its last token."""
        lookup = req.prompt_lookup
        if lookup is None:
            lookup = req.prompt_lookup = PromptLookup(
                req.prompt_token_ids, self.config.prompt_lookup_min_ngram, self.config.prompt_lookup_max_ngram)
        if lookup.num_tokens < req.num_tokens:
            lookup.extend(req.output_token_ids[lookup.num_tokens - req.num_prompt_tokens :])
        return lookup

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step ran: everything it fed is in the KV cache now."""
        for item in output.scheduled:
            item.request.num_cached += item.num_new_tokens

    def _preempt_until_decodes_fit(self) -> list[Request]:
        preempted = []
        while self._num_decode_tokens() > self._num_uncommitted_slots():
            # The cache's unused entries go first; then requests.
            self._make_room(self._num_decode_tokens() - self._num_uncommitted_slots())
            if self._num_decode_tokens() <= self._num_uncommitted_slots():
                break
            newest = max(self.running, key=lambda req: req.arrival_time)
            self._preempt(newest)
            preempted.append(newest)
        return preempted

    def _preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self.running.remove(req)
        self.leave_cache(req, keep=True)   # what it computed stays in the tree: its re-prefill matches it
        req.num_cached = 0
        req.status = RequestStatus.WAITING
        # At the front, so it resumes before every request that arrived after it.
        self.waiting.appendleft(req)

    def _admit_waiting(self, budget: _PrefillBudget) -> list[ScheduledRequest]:
        """Move waiting requests into the running batch, in order, while they fit."""
        admitted: list[ScheduledRequest] = []
        self._order_waiting()
        while self.waiting:
            req = self.waiting[0]
            if req.num_pending_tokens:
                break   # preempted while its token was in flight: it waits for the step that reads it
            if len(self.running) >= self.config.max_running_requests:
                break
            node, num_hit = self._match(req)
            req.num_cached = num_hit
            # Room for the rest of its tokens (all of them but a cached prefix), plus one slot per
            # running request (this one included) for the next decode, so that admitting it does
            # not force a preemption right away. The cache's unused entries make room first.
            need = self._num_uncached(req) + len(self.running) + 1
            free = self._num_free_after_step()
            if free < need <= free + self._num_reclaimable_slots():   # else evict nothing in vain
                self._make_room(need - free)
                free = self._num_free_after_step()
            chunk = self._chunk(req, budget) if free >= need else 0
            if chunk == 0:
                req.num_cached = 0
                if node is not None:
                    self.cache.unlock(node)
                break
            self.waiting.popleft()
            self._queued_at.pop(req, None)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            if node is not None:
                req.cache_node, req.num_in_tree, req.num_cached_prefix = node, num_hit, num_hit
                self.num_cache_queried_tokens += req.num_tokens
                self.num_cache_hit_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(self._scheduled(req, chunk))
        return admitted

    def _chunk(self, req: Request, budget: _PrefillBudget) -> int:
        """How many of the request's uncached tokens this step prefills (0: none this step)."""
        num_uncached = self._num_uncached(req)
        # Prompt logprobs are computed over a whole prompt in one forward.
        splittable = self.config.chunked_prefill and not req.needs_prompt_logprobs
        if splittable:
            chunk = min(num_uncached, budget.left)
        elif num_uncached <= budget.left or budget.untouched:
            chunk = num_uncached   # the first prefill of a step may exceed the budget: it must run sometime
        else:
            chunk = 0
        budget.take(chunk)
        return chunk

    @staticmethod
    def _scheduled(req: Request, num_new_tokens: int) -> ScheduledRequest:
        return ScheduledRequest(req, num_new_tokens, samples=req.num_cached + num_new_tokens == req.num_tokens_with_pending,
                                prefill=True)

    # ----------------------------------------------------------------------------------
    # The prefix cache
    # ----------------------------------------------------------------------------------

    def _key(self, req: Request, n: int) -> list[int]:
        return req.cache_key(n, self.config.image_token_id, self.config.tokens_per_image)

    def _match(self, req: Request) -> tuple[Node | None, int]:
        """The request's longest cached prefix, locked: (its node, its length); (None, 0) with no
        cache. At least the last token stays uncached: its logits sample the next one. A request
        that wants prompt logprobs needs every prompt row computed: it matches nothing."""
        if self.cache is None:
            return None, 0
        if req.needs_prompt_logprobs:
            node, n = self.cache.root, 0
        else:
            node, n = self.cache.match(self._key(req, req.num_tokens - 1))
        self.cache.lock(node)
        return node, n

    def cache_prefill(self, req: Request, n: int) -> None:
        """A step that fed the request's first ``n`` tokens is done (its prefill is complete): put
        them in the tree now, so that requests arriving while it decodes share them."""
        if self.cache is None or req.cache_node is None:
            return
        node, added = self.cache.insert(self._key(req, n), req.req_id)
        if node is not req.cache_node:   # the lock moves down to the new deepest node
            self.cache.lock(node)
            self.cache.unlock(req.cache_node)
            req.cache_node = node
        req.num_in_tree += added

    def leave_cache(self, req: Request, keep: bool, upto: int | None = None) -> None:
        """The request stops using the tree (it finished, was preempted or retired): with
        ``keep``, its computed tokens (at most ``upto``, what it fed, and what it knows: never a
        token in flight) go in first, and a session's request pins them for the session's next
        turn."""
        if self.cache is None or req.cache_node is None:
            return
        if keep:
            n = min(req.num_cached, req.num_tokens, req.num_cached if upto is None else upto)
            if n > self.cache.depth(req.cache_node):
                self.cache_prefill(req, n)
            if req.session_id is not None:
                self._pin(req.session_id, req.cache_node)
        self.cache.unlock(req.cache_node)
        req.cache_node, req.num_in_tree = None, 0

    def has_cache_ops(self) -> bool:
        """The prefix cache has changes the workers have yet to mirror."""
        return self.cache is not None and bool(self.cache.ops)

    def _pin(self, session_id: str, node: Node) -> None:
        """Hold the session's conversation in the tree, in place of its previous turn's pin."""
        old = self.sessions.pop(session_id, None)
        self.cache.pin(node)
        if old is not None:
            self.cache.unpin(old)
        self.sessions[session_id] = node

    def end_session(self, session_id: str) -> None:
        """Unpin the session's conversation and free the tokens only it held: no request will
        send that conversation again (as LMDeploy frees a session at its end). A prefix it shares
        with other entries (a common system prompt, the same question asked elsewhere) stays."""
        node = self.sessions.pop(session_id, None) if self.cache is not None else None
        if node is not None:
            self.cache.release(node)

    def _make_room(self, num_slots: int) -> None:
        """Evict the tree's least recently used entries until ``num_slots`` more slots are free,
        or nothing unused is left; then release session pins, oldest first, and evict again.
        (Pins are soft: the session's next turn just prefills more.)"""
        if self.cache is None or num_slots <= 0:
            return
        freed = self.cache.evict(num_slots)
        while freed < num_slots and self.sessions:
            oldest = next(iter(self.sessions))
            self.cache.unpin(self.sessions.pop(oldest))
            freed += self.cache.evict(num_slots - freed)

    def _num_reclaimable_slots(self) -> int:
        """Slots ``_make_room`` could free: the tree's that no running request uses."""
        return self.cache.num_evictable_tokens + self.cache.num_pinned_tokens if self.cache is not None else 0

    def evict_all(self) -> int:
        """Evict every entry that no running request uses (session pins too); the slots freed."""
        if self.cache is None:
            return 0
        for node in self.sessions.values():
            self.cache.unpin(node)
        self.sessions.clear()
        return self.cache.evict(self.cache.num_tokens)

    def _order_waiting(self) -> None:
        """Cache-aware admission order (SGLang's longest-prefix-match, with an age bound): the
        preempted requests stay first, in their order; then the fresh ones that have waited
        ``prefix_wait_steps`` steps, oldest first; then the others, longest cached prefix first
        (arrival order among equals)."""
        if self.cache is None or self.cache.num_tokens == 0 or len(self.waiting) < 2:
            return
        waiting = list(self.waiting)
        first_fresh = next((i for i, r in enumerate(waiting) if r.first_scheduled_time is None), len(waiting))
        fresh = waiting[first_fresh : first_fresh + _MAX_RANKED_WAITING]
        if len(fresh) < 2:
            return

        def rank(req: Request) -> tuple:
            if self._num_steps - self._queued_at.get(req, self._num_steps) >= self.config.prefix_wait_steps:
                return (0, 0, req.arrival_time)
            n = 0 if req.needs_prompt_logprobs else self.cache.prefix_length(self._key(req, req.num_tokens - 1))
            return (1, -n, req.arrival_time)

        fresh.sort(key=rank)
        self.waiting = deque(waiting[:first_fresh] + fresh + waiting[first_fresh + len(fresh):])

    # ----------------------------------------------------------------------------------
    # Accounting
    # ----------------------------------------------------------------------------------

    @staticmethod
    def _num_uncached(req: Request) -> int:
        """Tokens the request has yet to feed: those not in the KV cache, the one in flight included."""
        return req.num_tokens_with_pending - req.num_cached

    def is_decoding(self, req: Request) -> bool:
        """A running request feeds one sampled token; the others are part-way through a prompt."""
        return self._num_uncached(req) == 1 and req.num_cached > 0

    def _num_decode_tokens(self) -> int:
        """Tokens the decoding requests feed this step (one each)."""
        return sum(1 for req in self.running if self.is_decoding(req))

    def _num_uncommitted_slots(self) -> int:
        """Free slots less those reserved for the rest of the prompts under way."""
        committed = sum(self._num_uncached(req) for req in self.running if not self.is_decoding(req))
        return self.num_free_slots - committed

    def _num_free_after_step(self) -> int:
        return self._num_uncommitted_slots() - self._num_decode_tokens()

    def _num_own_slots(self) -> int:
        """Slots the running requests hold that the prefix tree does not."""
        return sum(req.num_cached - req.num_in_tree for req in self.running)

    @property
    def num_used_slots(self) -> int:
        """Slots held by running requests (their own, and the tree's they use)."""
        return self._num_own_slots() + (self.cache.num_locked_tokens if self.cache is not None else 0)

    @property
    def num_cached_slots(self) -> int:
        """Slots held only by the prefix tree: evictable (a session's pinned ones too, last)."""
        return self.cache.num_tokens - self.cache.num_locked_tokens if self.cache is not None else 0

    @property
    def num_free_slots(self) -> int:
        tree = self.cache.num_tokens if self.cache is not None else 0
        return self.config.max_total_token_num - self._num_own_slots() - tree

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)


class _PrefillBudget:
    """Prompt tokens one step may still prefill."""

    def __init__(self, limit: int):
        self.left = limit
        self.taken = 0
        self.untouched = True

    def take(self, n: int) -> None:
        if n:
            self.left = max(0, self.left - n)
            self.taken += n
            self.untouched = False
