"""A request as the front end keeps it (the HTTP process, or the offline ``LLM``): the tokens the
engine reports for it, and their text, which is made here and not in the engine core.

The engine core sees token ids only. Text is made on the front end's side because it is the
front end that streams it: the core's step then spends nothing on it, and the core process
needs no tokenizer (so imports neither transformers nor torch). Stop strings are matched here
too, as they are matched in text; a match ends the request here, and the caller aborts it in
the engine (which may run it for a step more meanwhile: that token is dropped).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from llmserve.detokenize import IncrementalDetokenizer
from llmserve.engine.request import FinishReason, RequestDelta
from llmserve.ipc import error_line
from llmserve.sampling_params import SamplingParams


class Detokenizer(Protocol):
    """One request's incremental detokenizer (``llmserve.detokenize.IncrementalDetokenizer``)."""

    def step(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(eq=False)
class ClientRequest:
    req_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    # Each output token's own text, as the detokenizer gave it in context ("" for a stop or EOS
    # token, whose text is never shown, and for one that ends mid-character): unlike the
    # streamed deltas, never shifted by a stop string's hold-back or cut.
    output_token_texts: list[str] = field(default_factory=list)
    # Filled only when params.logprobs is not None, one entry per output token.
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None          # why the request failed (finish_reason ERROR)
    # Prompt tokens the engine took from its prefix cache (RequestDelta.num_cached_tokens); None
    # until the first token.
    num_cached_tokens: int | None = None

    # The detokenized output. A matched stop string and everything after it are cut off,
    # and the text of a stop token or EOS token is never added.
    output_text: str = ""
    # How much of output_text take_stream_delta() has already handed out.
    num_streamed_chars: int = 0

    @classmethod
    def start(cls, req_id: int, prompt_token_ids: list[int], params: SamplingParams, tokenizer) -> ClientRequest:
        """A request about to be sent to the engine, with a detokenizer of ``tokenizer`` primed
        with the prompt (so its first output token decodes in context)."""
        return cls(req_id, list(prompt_token_ids), params, IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    # ----------------------------------------------------------------------------------
    # One step's delta
    # ----------------------------------------------------------------------------------

    def apply(self, delta: RequestDelta) -> bool:
        """Take what the engine's step did to the request. Returns True when the request ended
        here while the engine still runs it (a stop string, text that will not decode): the
        caller must abort it in the engine.

        The rules, in this order:

        1. the delta carries an error: the request failed in the engine; nothing else is taken;
        2. prompt logprobs, if the delta has them, are recorded;
        3. the token is detokenized, unless the engine ended the request on it as a stop token or
           an EOS token (``Request.append_token``, rules 1 and 2), whose text is never shown; a
           detokenizer error fails the request, without the token;
        4. if the engine ended the request with this delta, the text the detokenizer still holds
           back (the end of the output is an unfinished character) is decoded as it is, U+FFFD
           and all, and added to the last shown token's text: the output never loses its end;
        5. the token is recorded with its own text, and its logprobs when the request asked for
           them, and its text is added to output_text;
        6. past the first ``params.min_tokens`` tokens, a stop string in the text ends the
           request (STOP_SEQUENCE, even on the engine's last allowed token) and the text is cut
           right before it;
        7. otherwise the engine's finish reason, if any (LENGTH, ABORT), stands.
        """
        assert not self.is_finished, f"request {self.req_id} got a delta after it finished"
        if delta.error is not None:
            self.finish_reason, self.error = FinishReason.ERROR, delta.error
            return False
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
        assert delta.token_id is not None, delta     # only a failed request's delta has no token
        hidden = delta.finish_reason in (FinishReason.STOP_SEQUENCE, FinishReason.EOS_TOKEN)
        try:
            text_delta = "" if hidden else self.detokenizer.step(delta.token_id)
            tail = self.detokenizer.flush() if delta.finish_reason is not None else ""
        except Exception as e:         # a tokenizer that cannot decode its tokens: this request's failure
            self.finish_reason, self.error = FinishReason.ERROR, f"its output could not be decoded: {error_line(e)}"
            return delta.finish_reason is None
        if hidden:              # the tail is the text of the tokens before the hidden one...
            if self.output_token_texts:
                self.output_token_texts[-1] += tail
            else:
                tail = ""       # ...or of the prompt's end, which is not output
        else:
            text_delta += tail
        self.output_token_ids.append(delta.token_id)
        self.output_token_texts.append(text_delta)
        if self.params.logprobs is not None:
            self.output_logprobs.append(delta.logprob)
            self.output_top_logprobs.append(delta.top_logprobs or [])
        if hidden:
            self.output_text += tail
            self.finish_reason = delta.finish_reason
            return False
        self.output_text += text_delta
        may_stop = self.num_output_tokens > self.params.min_tokens
        if may_stop and self._cut_at_stop_string(num_new_chars=len(text_delta)):
            self.finish_reason = FinishReason.STOP_SEQUENCE
            return delta.finish_reason is None
        self.finish_reason = delta.finish_reason
        return False

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
