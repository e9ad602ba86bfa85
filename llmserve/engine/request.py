"""Router-side state of one generation request, and the rules that decide when it stops.

The router owns one ``Request`` per client request. The scheduler moves it between the
waiting queue and the running batch; after every forward pass the engine hands the sampled
token (and the text the detokenizer made of it) to :meth:`Request.append_token`, which
records it and decides whether the request is done.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Set
from dataclasses import dataclass, field

from llmserve.sampling_params import SamplingParams


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
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Why the request failed (finish_reason ERROR): one line, fit for the client.
    error: str | None = None

    # The detokenized output. A matched stop string and everything after it are cut off,
    # and the text of a stop token or EOS token is never added.
    output_text: str = ""
    # How much of output_text take_stream_delta() has already handed out.
    num_streamed_chars: int = 0

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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

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
        text_delta: str,
        *,
        eos_token_ids: Set[int] = frozenset(),
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> FinishReason | None:
        """Record a sampled token and its text; finish the request if a stop rule fires.

        ``text_delta`` is what the incremental detokenizer returned for this token. The
        rules are checked in this order, first match wins:

        1. the token is one of ``params.stop_token_ids``: stop, its text is not shown;
        2. the token is an EOS token and EOS is not ignored: stop, its text is not shown;
        3. the text now contains a stop string: stop, the text is cut right before it;
        4. ``max_new_tokens`` tokens have been generated: stop.

        The first ``params.min_tokens`` tokens are checked against rule 4 only (the sampler
        never picks an EOS or stop token for them; a stop string in their text is let through).

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
        else:
            self.output_text += text_delta
            if may_stop and self._cut_at_stop_string(num_new_chars=len(text_delta)):
                self.finish(FinishReason.STOP_SEQUENCE)
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

    def _cut_at_stop_string(self, num_new_chars: int) -> bool:
        """Cut output_text right before the earliest stop string; True if one was found.

        The text before this step's delta held no stop string (or we would have stopped
        already), so a new match must end inside the delta: only the last
        ``num_new_chars + len(stop) - 1`` characters need searching.
        """
        if num_new_chars == 0:
            return False
        match_starts = []
        for stop in self.params.stop:
            search_from = max(0, len(self.output_text) - num_new_chars - len(stop) + 1)
            start = self.output_text.find(stop, search_from)
            if start != -1:
                match_starts.append(start)
        if not match_starts:
            return False
        self.output_text = self.output_text[: min(match_starts)]
        return True

    # ----------------------------------------------------------------------------------
    # Streaming
    # ----------------------------------------------------------------------------------

    @property
    def stream_holdback(self) -> int:
        """How many trailing characters may not be streamed yet.

        While the request runs, its last ``len(longest stop) - 1`` characters could still
        turn into the start of a stop string, which the client must never see. Once it has
        finished, output_text is final and nothing is held back.
        """
        if self.is_finished or not self.params.stop:
            return 0
        return max(len(stop) for stop in self.params.stop) - 1

    @property
    def streamable_text(self) -> str:
        """The prefix of output_text that is safe to send to a client now."""
        num_safe_chars = max(0, len(self.output_text) - self.stream_holdback)
        return self.output_text[:num_safe_chars]

    def take_stream_delta(self) -> str:
        """The streamable text not handed out yet; it counts as handed out from now on.

        Concatenating every delta gives the final output_text: a stop string, when cut
        off, always starts inside the text that was being held back.
        """
        streamable = self.streamable_text
        delta = streamable[self.num_streamed_chars :]
        self.num_streamed_chars = len(streamable)
        return delta
