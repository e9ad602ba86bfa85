"""Continuous batching: which requests take part in the next forward pass.

Each step mixes decodes and prefills in one batch. The running requests all go: each
feeds the token it sampled last step. If the KV pool cannot hold those tokens, the newest
running requests are preempted (their cache is dropped; they are prefilled again later,
ahead of every newer arrival). Then waiting requests are admitted in arrival order while
they fit. The scheduler only does the bookkeeping; the engine runs the step and tells it
what happened (``update_after_step``, ``finish_request``).

KV accounting is in token slots: a request holds ``num_cached`` slots. A step that feeds
``n`` new tokens of a request needs ``n`` free slots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llmserve.server.router.request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_total_token_num: int  # KV pool size in token slots
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192  # per step; a single larger prompt still runs, alone


@dataclass
class ScheduledRequest:
    request: Request
    # Feed all_token_ids[num_cached : num_cached + num_new_tokens] this step.
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Requests taken out of the running batch: the workers must free their KV cache
    # before running this step.
    preempted: list[Request]


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ----------------------------------------------------------------------------------
    # Requests in and out
    # ----------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.num_prompt_tokens == 0:
            raise ValueError(f"request {req.req_id} has an empty prompt")
        max_len = req.num_prompt_tokens + req.params.max_new_tokens
        if max_len > self.config.max_total_token_num:
            raise ValueError(
                f"request {req.req_id} needs up to {max_len} tokens (prompt + max_new_tokens) "
                f"but the KV cache holds {self.config.max_total_token_num}"
            )
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish_request(self, req: Request, reason: FinishReason) -> None:
        """Drop a request; its KV slots count as free from now on."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.finish(reason)

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
        scheduled = [ScheduledRequest(req, self._num_uncached(req)) for req in self.running]
        scheduled += self._admit_waiting()
        return SchedulerOutput(scheduled, preempted)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step ran: everything it fed is in the KV cache now."""
        for item in output.scheduled:
            item.request.num_cached += item.num_new_tokens

    def _preempt_until_decodes_fit(self) -> list[Request]:
        preempted = []
        while self._num_decode_tokens() > self.num_free_slots:
            newest = max(self.running, key=lambda req: req.arrival_time)
            self._preempt(newest)
            preempted.append(newest)
        return preempted

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.num_cached = 0
        req.status = RequestStatus.WAITING
        # At the front, so it resumes before every request that arrived after it.
        self.waiting.appendleft(req)

    def _admit_waiting(self) -> list[ScheduledRequest]:
        """Move waiting requests into the running batch, in order, while they fit."""
        admitted: list[ScheduledRequest] = []
        free_after_step = self.num_free_slots - self._num_decode_tokens()
        prefill_tokens = 0
        while self.waiting:
            req = self.waiting[0]
            num_new_tokens = self._num_uncached(req)  # the whole sequence: num_cached is 0
            if len(self.running) >= self.config.max_running_requests:
                break
            # The first prefill of a step may exceed the budget: a long prompt must run sometime.
            if admitted and prefill_tokens + num_new_tokens > self.config.max_prefill_tokens:
                break
            # Keep one slot per running request (this one included) for the next decode,
            # so that admitting it does not force a preemption right away.
            if free_after_step - num_new_tokens < len(self.running) + 1:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(ScheduledRequest(req, num_new_tokens))
            prefill_tokens += num_new_tokens
            free_after_step -= num_new_tokens
        return admitted

    # ----------------------------------------------------------------------------------
    # Accounting
    # ----------------------------------------------------------------------------------

    @staticmethod
    def _num_uncached(req: Request) -> int:
        return req.num_tokens - req.num_cached

    def _num_decode_tokens(self) -> int:
        """Tokens the running requests feed this step (one each, normally)."""
        return sum(self._num_uncached(req) for req in self.running)

    @property
    def num_used_slots(self) -> int:
        return sum(req.num_cached for req in self.running)

    @property
    def num_free_slots(self) -> int:
        return self.config.max_total_token_num - self.num_used_slots

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
