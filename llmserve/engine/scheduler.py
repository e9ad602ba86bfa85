"""Continuous batching: which requests take part in the next forward pass.

Each step mixes decodes and prefills in one batch. The running requests that are decoding all
go: each feeds the token it sampled last step. If the KV pool cannot hold those tokens, the
prefix cache gives up what no running request uses (prefix_cache.py), then the newest running
requests are preempted (their cache is dropped; they are prefilled again later, ahead of every
newer arrival). Then prefills fill the step's prefill budget (``max_prefill_tokens``): first the
prompts already under way, then waiting requests: the preempted ones, then the others in arrival
order (with the prefix cache, longest cached prefix first). A prompt longer than what is left of
the budget is split over several steps (chunked prefill), so a burst of long prompts never stalls
the running decodes for more than one budget's worth of compute; the request samples its first
token with its last chunk. A request with a LoRA adapter is admitted once its adapter has a slot
in the workers' pool (``LoraManager``): a running request holds its adapter's slot, and when
every slot is held the queue waits for one to free. Last, decodes may bring drafts in what the step leaves (speculation:
drafting.py). The scheduler only does the bookkeeping; the engine runs the step and tells it
what happened (``update_after_step``, ``finish_request``).

KV accounting is in token slots: a request holds ``num_cached`` slots, ``num_in_tree`` of them
shared with the prefix tree. A step that feeds ``n`` new tokens of a request needs ``n`` free slots.
Admitting a request reserves room for its whole prompt at once, so a prefill that has started
can always finish.

With the overlapped loop the engine schedules a step before it has read the tokens of the step
still running: a request's tokens then include the one in flight (``num_pending_tokens``), which
its decode feeds like any other. A request whose final token (``max_new_tokens``) is in flight
is retired at once (``retire``): the batches are then the plain loop's, step for step. A decode
with a draft budget may add up to that many tokens more, which the engine learns once it reads
the step: until then the request holds the budget's slots (``Request.num_draft_slots``), and it is
retired only when its certain count reaches ``max_new_tokens`` (a step scheduled for it meanwhile
may find it done: its token is dropped, as after an EOS).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from llmserve.engine.drafting import DraftCost, Drafter
from llmserve.engine.prefix_cache import PrefixCacheManager
from llmserve.engine.request import FinishReason, Request, RequestStatus
from llmserve.lora.manager import LoraManager


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
    # What a step costs the device by its rows, drafts or not (drafting.DRAFT_COSTS): a step's
    # budgets are cut to the lengths that pay. Zero: as long as their match allows.
    draft_cost: DraftCost = DraftCost()
    # Keep requests' tokens in a radix tree (radix_cache.py) and start each request from its
    # longest cached prefix. (The engine's default is on; bare schedulers in tests run without.)
    prefix_cache: bool = False
    # Cache-aware admission: waiting requests with longer cached prefixes go first, but one that
    # has waited this many steps goes before every younger one (no starvation).
    prefix_wait_steps: int = 64
    # How prompts with images are keyed (Request.cache_key); None: a text-only model.
    image_token_id: int | None = None
    tokens_per_image: int = 0
    # LoRA adapters: name -> local directory, and the slots of the workers' pool.
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 0


@dataclass
class ScheduledRequest:
    request: Request
    # Feed all_token_ids[num_cached : num_cached + num_new_tokens] this step.
    num_new_tokens: int
    # The step reaches the end of the request's tokens, so it samples the next one (false for
    # every chunk of a split prompt but the last).
    samples: bool = True
    # Speculation: the most draft tokens rank 0 may feed after the decode's sampled token (it
    # proposes them: drafting.py); their KV slots are reserved until the step is read.
    draft_budget: int = 0
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
    num_draft_slots: int = 0      # the draft budgets granted (rank 0 may draft fewer)

    @property
    def num_tokens(self) -> int:
        """The tokens the step feeds, bar its drafts (known once the step is read)."""
        return self.num_decode_tokens + self.num_prefill_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0     # since start, for /metrics
        self.prefix_cache = PrefixCacheManager(config.prefix_cache, config.prefix_wait_steps,
                                               config.image_token_id, config.tokens_per_image)
        self.drafter = Drafter(config.speculate, config.speculate_max_batch, config.draft_cost)
        self.loras = LoraManager(config.lora_modules, config.max_loras)

    # ----------------------------------------------------------------------------------
    # Requests in and out
    # ----------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        # Admitted by check_request (engine/admission.py), whose limits are within the KV pool's.
        assert req.num_prompt_tokens > 0, req.req_id
        assert req.num_prompt_tokens + req.params.max_new_tokens <= self.config.max_total_token_num, req.req_id
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.prefix_cache.queued(req)

    def finish_request(self, req: Request, reason: FinishReason) -> None:
        """Drop a request; its KV slots count as free from now on."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        # What it fed, bar its last token: the plain loop never feeds that one (the overlapped one
        # may have), and both must leave the same tree.
        self.prefix_cache.leave(req, keep=reason is not FinishReason.ERROR, upto=req.num_tokens - 1)
        self.drafter.forget(req)
        self._release_lora_slot(req)
        req.finish(reason)

    def retire(self, req: Request) -> bool:
        """Take out of the running batch a request with nothing left to schedule (its final token
        is in flight): its KV slots count as free from now on, as the workers free them before
        the next step. It finishes when that token is read (``finish_request``). False if it was
        not running (retired already: a step of it failed and ran again)."""
        if req not in self.running:
            return False
        self.running.remove(req)
        # (The step in flight still uses the adapter's slot: a load into it comes with a later
        # step, which the device runs after this one.)
        self._release_lora_slot(req)
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
        num_draft_slots = 0
        if self.drafter.takes_drafts(num_decodes):
            # What the step leaves, less one slot per running request for its next decode: a
            # draft never forces a preemption.
            room = min(budget.left, self._num_uncommitted_slots() - num_decodes - len(self.running))
            num_draft_slots = self.drafter.add_drafts(scheduled[:num_decodes], room)
        return SchedulerOutput(scheduled, preempted, num_decodes, budget.taken, num_draft_slots)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step ran: everything it fed is in the KV cache now, and its drafts hold their
        budgets' slots until the step is read (the engine then counts what was kept)."""
        for item in output.scheduled:
            item.request.num_cached += item.num_new_tokens
            item.request.num_draft_slots += item.draft_budget

    def _preempt_until_decodes_fit(self) -> list[Request]:
        preempted = []
        while self._num_free_after_step() < 0:
            # The cache's unused entries go first; then requests, newest first.
            self.prefix_cache.make_room(-self._num_free_after_step())
            if self._num_free_after_step() >= 0:
                break
            newest = max(self.running, key=lambda req: req.arrival_time)
            self._preempt(newest)
            preempted.append(newest)
        return preempted

    def _preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self.running.remove(req)
        self.prefix_cache.leave(req, keep=True)   # what it computed stays in the tree: its re-prefill matches it
        self._release_lora_slot(req)
        req.num_cached = 0
        req.status = RequestStatus.WAITING
        # At the front, so it resumes before every request that arrived after it.
        self.waiting.appendleft(req)

    def _admit_waiting(self, budget: _PrefillBudget) -> list[ScheduledRequest]:
        """Move waiting requests into the running batch, in order, while they fit."""
        admitted: list[ScheduledRequest] = []
        self.waiting = self.prefix_cache.order(self.waiting)
        while self.waiting:
            req = self.waiting[0]
            if req.num_pending_tokens:
                break   # preempted while its token was in flight: it waits for the step that reads it
            if len(self.running) >= self.config.max_running_requests:
                break
            if not self._take_lora_slot(req):
                break   # every adapter slot is held by running requests: the queue waits for one
            req.num_cached = self.prefix_cache.match(req)
            chunk = self._chunk(req, budget) if self._make_room_for(req) else 0
            if chunk == 0:
                req.num_cached = 0
                self.prefix_cache.release(req)
                self._release_lora_slot(req)
                break
            self.waiting.popleft()
            self.prefix_cache.admitted(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(self._scheduled(req, chunk))
        return admitted

    def _take_lora_slot(self, req: Request) -> bool:
        """Give a request about to run its adapter's slot (False: none is free)."""
        if req.lora_name is None:
            return True
        slot = self.loras.acquire(req.lora_name)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _release_lora_slot(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.loras.release(req.lora_slot)
            req.lora_slot = -1

    def _make_room_for(self, req: Request) -> bool:
        """Whether the KV pool holds the rest of the request's tokens (all of them but a cached
        prefix), plus one slot per running request (this one included) for the next decode, so
        that admitting it does not force a preemption right away. The cache's unused entries make
        room first."""
        need = self._num_uncached(req) + len(self.running) + 1
        free = self._num_free_after_step()
        if free < need <= free + self.prefix_cache.num_reclaimable_tokens:   # else evict nothing in vain
            self.prefix_cache.make_room(need - free)
            free = self._num_free_after_step()
        return free >= need

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
        """Slots the running requests hold that the prefix tree does not (their drafts' in flight too)."""
        return sum(req.num_cached + req.num_draft_slots - req.num_in_tree for req in self.running)

    @property
    def num_used_slots(self) -> int:
        """Slots held by running requests (their own, and the tree's they use)."""
        return self._num_own_slots() + self.prefix_cache.tree.num_locked_tokens

    @property
    def num_cached_slots(self) -> int:
        """Slots held only by the prefix tree: evictable (a session's pinned ones too, last)."""
        return self.prefix_cache.num_reclaimable_tokens

    @property
    def num_free_slots(self) -> int:
        return self.config.max_total_token_num - self._num_own_slots() - self.prefix_cache.tree.num_tokens

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
