"""LMDeploy's ``POST /v1/chat/interactive``: a chat whose history the server keeps.

A request brings only its new user turn (``prompt``, a string or a list of messages) and a
``session_id``; with ``interactive_mode`` true the session lives on after the turn, false (the
default, as LMDeploy's) makes this turn its last. ``session_id`` -1 picks a new id (the response
says which). ``cancel`` stops the session's running turn and ends it; LMDeploy's ``end_session``
(an empty ``prompt``, ``request_output_len`` 0 and ``interactive_mode`` false) ends it too, and the
engine drops the tokens only it held. The answer is LMDeploy's
``{text, tokens, input_tokens, history_tokens, finish_reason}`` plus ``session_id`` and
``cached_tokens`` (the prompt tokens the prefix cache held); streamed, one such JSON object per
line, each with the text that became safe to show. Errors are OpenAI's shape, as on the other
/v1 routes. Sessions themselves: server/sessions.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import Field

from llmserve.chat_template import ChatTemplateError
from llmserve.server.api.errors import APIError, require, template_error
from llmserve.server.api.openai.convert import (
    chat_max_tokens, chat_messages, check_model, openai_fields, sampling_params,
)
from llmserve.server.api.openai.render import finish_reason
from llmserve.server.api.openai.schema import ChatMessage, SamplingFields
from llmserve.server.api.state import ServerState, stream_with_cleanup
from llmserve.server.engine_client import RequestStream
from llmserve.server.sessions import MAX_SESSION_ID, NEW_SESSION, Session, SessionStore, answer_token_ids

ENDED_BY_CANCEL = "the session's turn was cancelled (a request with `cancel: true`)"
ENDED_BY_CLIENT = "the session was ended (an empty prompt with request_output_len 0)"
FIELDS = openai_fields("prompt", "request_output_len", "logprobs")


class InteractiveRequest(SamplingFields):
    """LMDeploy's fields; OpenAI's sampling fields (seed, stop_token_ids, response_format, ...) work too."""
    prompt: str | list[ChatMessage] = ""
    session_id: int = Field(NEW_SESSION, ge=NEW_SESSION, le=MAX_SESSION_ID)
    interactive_mode: bool = False
    request_output_len: int | None = None
    cancel: bool = False
    image_url: Any = None          # LMDeploy's, for its vision models: refused here rather than ignored
    adapter_name: str | None = None  # LMDeploy's: the LoRA adapter (a name of --lora-modules; None: the base model)

    @property
    def ends_session(self) -> bool:
        """LMDeploy's ``end_session`` call, as its ``APIClient`` sends it."""
        return self.prompt == "" and self.request_output_len == 0 and not self.interactive_mode


def turn_messages(body: InteractiveRequest) -> list[dict[str, Any]]:
    """The new turn as the chat template takes messages: a string is one user message."""
    require(body.image_url is None, "images are not supported in interactive sessions", "image_url")
    if isinstance(body.prompt, str):
        require(body.prompt != "", "prompt must not be empty", "prompt")
        return [{"role": "user", "content": body.prompt}]
    require(len(body.prompt) > 0, "prompt must not be empty", "prompt")
    messages, image_urls = chat_messages(body.prompt, "prompt")
    require(not image_urls, "images are not supported in interactive sessions", "prompt")
    return messages


def continuation(state: ServerState, messages: list[dict[str, Any]]) -> list[int]:
    """The tokens a later turn adds to the session's: the template's continuation after the
    previous answer (``sequence_start=False``), without a BOS."""
    try:
        text = state.chat_template.template.continuation(messages)
    except ChatTemplateError as e:
        raise template_error(str(e), "prompt") from None
    return state.encode(text, "prompt", add_special_tokens=False)


@dataclass
class Turn:
    """One request's turn: the session it belongs to (None: a one-off chat), and its prompt, the
    session's tokens so far followed by the turn's own."""
    sessions: SessionStore
    session: Session | None
    session_id: int
    interactive: bool
    history: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)

    @property
    def prompt(self) -> list[int]:
        # Copied per use (twice a turn), not kept: the history is token ids, never re-rendered or
        # re-tokenized, and the copy (80 us at 32k tokens) is a tenth of pickling the prompt to
        # the engine core, which every turn must do anyway (the core takes whole prompts).
        return [*self.history, *self.new_tokens]

    @property
    def engine_session(self) -> str | None:
        """The id the engine pins the turn's tokens under. A session's last turn has it too: the
        ``EndSession`` that follows then unpins the whole conversation, not just the turn before."""
        return self.session.engine_id if self.session is not None else None

    def answer(self, stream: RequestStream, text: str, reason: str | None, tokens: int) -> dict[str, Any]:
        return {"text": text, "tokens": tokens, "input_tokens": len(self.new_tokens),
                "history_tokens": len(self.history), "finish_reason": reason, "session_id": self.session_id,
                # the prompt tokens the engine's prefix cache held (known from the first token on)
                "cached_tokens": stream.request.num_cached_tokens or 0}

    def refused(self) -> None:
        """The turn was refused before it ran: the session is as it was."""
        if self.session is not None:
            self.sessions.end_turn(self.session, None, None, keep=True)

    def finished(self, stream: RequestStream, encode: Callable[[str], list[int]]) -> None:
        """The turn's request is over (done, failed, aborted): the session takes its answer."""
        if self.session is not None:
            answer_ids = answer_token_ids(stream.request, encode)
            self.sessions.end_turn(self.session, self.prompt, answer_ids, keep=self.interactive)


async def open_turn(state: ServerState, body: InteractiveRequest) -> Turn:
    """The request's turn: its session marked busy (opened if new) and its new tokens rendered;
    a turn refused here leaves its session as it was."""
    messages = turn_messages(body)
    sessions = state.sessions
    session_id = sessions.new_id() if body.session_id == NEW_SESSION else body.session_id
    # A last turn of no session is a one-off chat; any other turn is a session's.
    in_session = body.interactive_mode or session_id in sessions
    turn = Turn(sessions, sessions.begin_turn(session_id) if in_session else None, session_id, body.interactive_mode)
    try:
        if turn.session is not None and turn.session.token_ids:
            turn.history = turn.session.token_ids
            turn.new_tokens = await state.tokenize_in_thread(continuation, state, messages)
        else:
            turn.new_tokens = await state.tokenize_in_thread(state.encode_chat, messages)
        if turn.session is not None and turn.session.ended:      # cancelled meanwhile
            raise APIError(ENDED_BY_CANCEL, HTTPStatus.CONFLICT, "validation", "session_id")
    except BaseException:
        turn.refused()
        raise
    return turn


def build_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    def encode_answer(text: str) -> list[int]:
        # an answer cut at a stop string: short, tokenized on the event loop's own tokenizer
        return state.tokenizer(text, add_special_tokens=False).input_ids

    @router.post("/chat/interactive")
    async def chat_interactive(body: InteractiveRequest, http_request: HTTPRequest):
        if state.config.api_server_count > 1:
            # A session's turns and cached tokens are kept by one HTTP process, and a client's next
            # connection may reach another: refused rather than served from the wrong one's state.
            raise APIError("interactive sessions need a server of one HTTP process (--api-server-count 1)",
                           HTTPStatus.NOT_IMPLEMENTED, "not_implemented")
        lora_name = check_model(state, body.model)
        if body.adapter_name is not None:
            require(body.adapter_name in state.lora_modules,
                    f"adapter `{body.adapter_name}` is not loaded (served: {', '.join(state.lora_modules) or 'none'})",
                    "adapter_name")
            lora_name = body.adapter_name
        if body.cancel or body.ends_session:
            # LMDeploy answers both with an empty turn, 200 even where no such session is open.
            action = "`cancel`" if body.cancel else "ending a session"
            require(body.session_id != NEW_SESSION, f"{action} needs the `session_id` of the session", "session_id")
            state.sessions.end(body.session_id, ENDED_BY_CANCEL if body.cancel else ENDED_BY_CLIENT)
            return {"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0, "finish_reason": "stop",
                    "session_id": body.session_id, "cached_tokens": 0}
        require(body.n == 1, "an interactive turn has one answer: n must be 1", "n")
        state.require_chat_template("prompt")
        turn = await open_turn(state, body)
        try:
            prompt = turn.prompt
            max_tokens = chat_max_tokens(state, len(prompt), body.request_output_len, "request_output_len", "prompt")
            params = sampling_params(body, state, len(prompt), max_tokens, None, FIELDS,
                                     defaults=state.chat_template.template, template_stop=state.chat_stop)
            streams, slot = state.start_all([(prompt, params)], FIELDS, session_id=turn.engine_session,
                                            lora_name=lora_name)
        except BaseException:
            turn.refused()
            raise
        stream = streams[0]
        if turn.session is not None:
            turn.session.running = stream
        if not body.stream:
            try:
                await state.run_to_end(streams, slot, http_request)
            finally:
                turn.finished(stream, encode_answer)
            request = stream.request
            return turn.answer(stream, request.output_text, finish_reason(request.finish_reason), request.num_output_tokens)

        async def lines() -> AsyncIterator[dict[str, Any]]:
            tokens = 0       # each event is one token: the count so far, whatever the engine has done since
            async for event in stream:
                tokens += 1
                yield turn.answer(stream, event.text, finish_reason(event.finish_reason), tokens)

        async def encoded() -> AsyncIterator[str]:
            try:
                async for item in stream_with_cleanup(streams, lines(), state, slot,
                                                      error_items=lambda error: [error.openai_body()]):
                    yield json.dumps(item, ensure_ascii=False) + "\n"
            finally:
                turn.finished(stream, encode_answer)

        return StreamingResponse(encoded(), media_type="application/x-ndjson")

    return router
