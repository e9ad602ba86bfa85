"""Engine-side state of one generation request, and the token rules that decide when it stops.

The engine owns one ``Request`` per client request. The scheduler moves it between the
waiting queue and the running batch; after every forward pass the engine hands the sampled
token to :meth:`Request.append_token`, which records it and decides whether the request is
done. The engine sees token ids only: the text, and the stop strings found in it, are the
front end's (``llmserve.output.ClientRequest``), which aborts the request when one matches.
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from llmserve.engine.radix_cache import Node


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # queued: nothing of it is in the KV cache
    RUNNING = enum.auto()  # in the running batch: its tokens are (being) cached
    FINISHED = enum.auto()


class FinishReason(str, enum.Enum):
    """Why a request stopped. The values are the names TGI reports to clients."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    ABORT = "abort"
    ERROR = "error"            # the request failed (see Request.error); the engine went on


@dataclass(eq=False)  # a request is an entity: equal only to itself, and hashable
class Request:
    req_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    # The images of the prompt, preprocessed ([3, H, W] float32 each, in prompt order); the
    # prompt holds their placeholder tokens. Kept until the request finishes: a re-prefill after
    # a preemption sends them again (the workers still have their features and do not re-encode).
    pixel_values: list[np.ndarray] | None = None

    output_token_ids: list[int] = field(default_factory=list)
    # Filled only when params.logprobs is not None, one entry per output token.
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Set once, by the request's first prefill, when params.prompt_logprobs is not None: one
    # entry per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    # How many of all_token_ids are in the KV cache right now. The scheduler resets it to
    # 0 when it preempts the request; the request is then prefilled again from scratch.
    num_cached: int = 0
    # Tokens drawn by a step still running, not read yet (0 or 1): the overlapped loop schedules
    # the next step before the last one reports, and the request's next step feeds that token
    # from the worker's side (BatchEntry.pending_token).
    num_pending_tokens: int = 0
    # KV slots granted to the drafts of steps in flight (``ScheduledRequest.draft_budget``), not
    # read yet: the request may have up to this many tokens more than its pending ones. Its
    # token count in flight is a range, at least ``num_pending_tokens``, at most that plus these;
    # only the former is certain (it retires on it), the latter is what its KV may reach.
    num_draft_slots: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # When the scheduler first let it into the running batch (time.monotonic); None until then.
    first_scheduled_time: float | None = None
    finish_reason: FinishReason | None = None
    # Why the request failed (finish_reason ERROR): one line, fit for the client.
    error: str | None = None
    # An interactive session's id: when the request finishes, the prefix cache keeps its tokens
    # pinned for the session's next turn.
    session_id: str | None = None
    # The LoRA adapter the request runs with (None: the base model): its name, its registration's
    # id (the prefix cache's key: LoraManager.ids), and while it runs, its slot in the workers' pool.
    lora_name: str | None = None
    lora_id: int = 0
    lora_slot: int = -1

    # The prefix cache's view (prefix_cache.py): the deepest tree node of the request's cached tokens
    # (it locks the node's path), None when it holds none; how many of its cached tokens' slots are
    # the tree's (the rest are its own); and how many tokens its latest admission took from the
    # cache (reported with its first token).
    cache_node: Node | None = field(default=None, repr=False)
    num_in_tree: int = 0
    num_cached_prefix: int = 0
    _image_keys: list[int] | None = field(default=None, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without concatenating the whole sequence (a decode step
        needs only its last token)."""
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:stop] + self.output_token_ids[: max(0, stop - n_prompt)]

    def cache_key(self, n: int, image_token_id: int | None = None, tokens_per_image: int = 0) -> list[int]:
        """The first ``n`` tokens as the prefix cache keys them: token ids, but an image's
        placeholders (all alike) by a hash of that image's pixels, so that prompts with different
        images never share their KV."""
        key = self.token_slice(0, n)
        if not self.pixel_values or image_token_id is None or not tokens_per_image:
            return key
        if self._image_keys is None:
            self._image_keys = [_image_key(px) for px in self.pixel_values]
        seen = 0
        for i, token in enumerate(key):
            if token == image_token_id:
                key[i] = self._image_keys[min(seen // tokens_per_image, len(self._image_keys) - 1)]
                seen += 1
        return key

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return self.num_tokens + self.num_pending_tokens

    @property
    def max_num_output_tokens(self) -> int:
        """The most output tokens the request may have once its steps in flight are read."""
        return self.num_output_tokens + self.num_pending_tokens + self.num_draft_slots

    @property
    def final_token_pending(self) -> bool:
        """The token in flight is the last ``max_new_tokens`` allows: nothing is left to schedule
        (the engine retires the request from the scheduler)."""
        return self.num_pending_tokens > 0 and self.num_output_tokens + self.num_pending_tokens >= self.params.max_new_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

    # ----------------------------------------------------------------------------------
    # One new token
    # ----------------------------------------------------------------------------------

    def append_token(
        self,
        token_id: int,
        *,
        eos_token_ids: Set[int] = frozenset(),
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> FinishReason | None:
        """Record a sampled token; finish the request if a stop rule fires.

        The rules are checked in this order, first match wins:

        1. the token is one of ``params.stop_token_ids``: stop (its text is never shown);
        2. the token is an EOS token and EOS is not ignored: stop (its text is never shown);
        3. ``max_new_tokens`` tokens have been generated: stop.

        The first ``params.min_tokens`` tokens are checked against rule 3 only (the sampler
        never picks an EOS or stop token for them). Stop strings are checked where the text
        is made (``ClientRequest.apply``), which then aborts the request here.

        Returns the finish reason, or None while the request goes on. The token itself is
        always recorded in ``output_token_ids``, whatever the outcome.
        """
        assert not self.is_finished, f"request {self.req_id} got a token after it finished"
        self.output_token_ids.append(token_id)
        if self.params.logprobs is not None:
            self.output_logprobs.append(logprob)
            self.output_top_logprobs.append(top_logprobs or [])

        may_stop = self.num_output_tokens > self.params.min_tokens
        if may_stop and token_id in self.params.stop_token_ids:
            self.finish(FinishReason.STOP_SEQUENCE)
        elif may_stop and token_id in eos_token_ids and not self.params.ignore_eos:
            self.finish(FinishReason.EOS_TOKEN)
        elif self.num_output_tokens >= self.params.max_new_tokens:
            self.finish(FinishReason.LENGTH)
        return self.finish_reason

    def set_prompt_logprobs(
        self, logprobs: list[float | None], top_logprobs: list[list[tuple[int, float]] | None]
    ) -> None:
        assert len(logprobs) == len(top_logprobs) == self.num_prompt_tokens
        self.prompt_logprobs = logprobs
        self.prompt_top_logprobs = top_logprobs

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for and not computed yet (a preempted request keeps those of its first prefill)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None


def _image_key(pixel_values: np.ndarray) -> int:
    """A negative int (token ids are not) that stands for one image in a prefix-cache key."""
    digest = hashlib.blake2b(repr((pixel_values.shape, str(pixel_values.dtype))).encode(), digest_size=8)
    digest.update(pixel_values.tobytes())
    return -1 - int.from_bytes(digest.digest(), "big") // 2


@dataclass
class RequestDelta:
    """What one step did to one request: the engine's whole report of it to the front end."""
    req_id: int
    token_id: int | None              # None when the request failed without a new token
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None          # the request failed on its own (finish_reason ERROR)
    # Sent once, with the request's first token, when it asked for them.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # Sent once, with the request's first token (for /metrics): seconds from its arrival in the
    # engine to its first scheduling (queue time), and from then to this token (prefill time).
    queue_time: float | None = None
    prefill_time: float | None = None
    # Sent once, with the request's first token: its prompt tokens that came from the prefix
    # cache (0 on a miss; None in every later delta).
    num_cached_tokens: int | None = None

    @classmethod
    def of(cls, req: Request) -> RequestDelta:
        """The delta of a request the engine's last step updated (``LLMEngine.step`` returns them)."""
        if req.error is not None:
            return cls(req.req_id, None, finish_reason=req.finish_reason, error=req.error)
        return cls.of_token(req, req.num_output_tokens - 1)

    @classmethod
    def of_token(cls, req: Request, index: int) -> RequestDelta:
        """The delta of output token ``index`` (a verify step emits several: one delta each, in
        order); the request's finish reason goes with its last token only."""
        first = index == 0   # prompt logprobs are ready by the first token: send them once
        last = index == req.num_output_tokens - 1
        scheduled = req.first_scheduled_time
        now = time.monotonic() if first and scheduled is not None else None
        return cls(
            req.req_id, token_id=req.output_token_ids[index],
            logprob=req.output_logprobs[index] if req.output_logprobs else None,
            top_logprobs=req.output_top_logprobs[index] if req.output_top_logprobs else None,
            finish_reason=req.finish_reason if last else None,
            prompt_logprobs=req.prompt_logprobs if first else None,
            prompt_top_logprobs=req.prompt_top_logprobs if first else None,
            queue_time=scheduled - req.arrival_time if now is not None else None,
            prefill_time=now - scheduled if now is not None else None,
            num_cached_tokens=min(req.num_cached_prefix, req.num_prompt_tokens) if first else None,
        )
