"""LMDeploy's ``POST /v1/chat/interactive``: a chat whose history the server keeps.

A request brings only its new user turn (``prompt``, a string or a list of messages) and a
``session_id``; with ``interactive_mode`` true the session lives on after the turn, false (the
default, as LMDeploy's) makes this turn its last. ``session_id`` -1 picks a new id (the response
says which). ``cancel`` stops the session's running turn and ends it. The answer is LMDeploy's
``{text, tokens, input_tokens, history_tokens, finish_reason}`` plus ``session_id`` and
``cached_tokens`` (the prompt tokens the prefix cache held); streamed, one
such JSON object per line, each with the text that became safe to show. Errors are OpenAI's shape,
as on the other /v1 routes. Sessions themselves: server/sessions.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import Field

from llmserve.chat_template import ChatTemplateError
from llmserve.server.api.errors import APIError, require, template_error
from llmserve.server.api.openai import (
    ChatMessage, SamplingFields, chat_max_tokens, chat_messages, check_model, finish_reason, openai_fields,
    sampling_params,
)
from llmserve.server.api.state import ServerState, stream_with_cleanup
from llmserve.server.engine_client import RequestStream
from llmserve.server.sessions import MAX_SESSION_ID, NEW_SESSION, Session, answer_token_ids

ENDED_BY_CANCEL = "the session's turn was cancelled (a request with `cancel: true`)"
FIELDS = openai_fields("prompt", "request_output_len", "logprobs")


class InteractiveRequest(SamplingFields):
    """LMDeploy's fields; OpenAI's sampling fields (seed, stop_token_ids, response_format, ...) work too."""
    prompt: str | list[ChatMessage] = ""
    session_id: int = Field(NEW_SESSION, ge=NEW_SESSION, le=MAX_SESSION_ID)
    interactive_mode: bool = False
    request_output_len: int | None = None
    cancel: bool = False


def turn_messages(body: InteractiveRequest) -> list[dict[str, Any]]:
    """The new turn as the chat template takes messages: a string is one user message."""
    if isinstance(body.prompt, str):
        require(body.prompt != "", "prompt must not be empty", "prompt")
        return [{"role": "user", "content": body.prompt}]
    require(len(body.prompt) > 0, "prompt must not be empty", "prompt")
    messages, image_urls = chat_messages(body.prompt, "prompt")
    require(not image_urls, "images are not supported in interactive sessions", "prompt")
    return messages


def continuation(state: ServerState, session: Session, messages: list[dict[str, Any]]) -> list[int]:
    """The tokens a later turn adds to the session's: the template's continuation after the
    previous answer (``sequence_start=False``), without a BOS."""
    try:
        text = state.chat_template.template.continuation(messages)
    except ChatTemplateError as e:
        raise template_error(str(e), "prompt") from None
    return state.encode(text, "prompt", add_special_tokens=False)


def answer(stream: RequestStream, text: str, input_tokens: int, history_tokens: int, session_id: int,
           reason: str | None) -> dict[str, Any]:
    return {"text": text, "tokens": stream.request.num_output_tokens, "input_tokens": input_tokens,
            "history_tokens": history_tokens, "finish_reason": reason, "session_id": session_id,
            # the prompt tokens the engine's prefix cache held (known from the first token on)
            "cached_tokens": stream.request.num_cached_tokens or 0}


def build_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")
    sessions = state.sessions

    @router.post("/chat/interactive")
    async def chat_interactive(body: InteractiveRequest, http_request: HTTPRequest):
        check_model(state, body.model)
        if body.cancel:
            require(body.session_id != NEW_SESSION, "`cancel` needs the `session_id` of the session to stop",
                    "session_id")
            sessions.end(body.session_id, ENDED_BY_CANCEL)
            return {"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0, "finish_reason": "stop",
                    "session_id": body.session_id}
        require(body.n == 1, "an interactive turn has one answer: n must be 1", "n")
        if state.chat_template is None:
            raise template_error("this model has no chat template: start the server with --chat-template "
                                 "NAME, FILE.json or FILE.jinja", "prompt")
        messages = turn_messages(body)
        session_id = sessions.new_id() if body.session_id == NEW_SESSION else body.session_id
        # A last turn of no session is a plain chat turn; any other is a turn of a session.
        session = sessions.begin_turn(session_id) if body.interactive_mode or session_id in sessions else None
        try:
            history = session.token_ids if session is not None else []
            if history:
                new_tokens = await state.tokenize_in_thread(continuation, state, session, messages)
            else:
                new_tokens = await state.tokenize_in_thread(state.encode_chat, messages)
            prompt = [*history, *new_tokens]
            max_tokens = chat_max_tokens(state, len(prompt), body.request_output_len, "request_output_len", "prompt")
            params = sampling_params(body, state, len(prompt), max_tokens, None, FIELDS,
                                     defaults=state.chat_template.template, template_stop=state.chat_stop)
            if session is not None and session.ended:
                raise APIError(ENDED_BY_CANCEL, HTTPStatus.CONFLICT, "validation", "session_id")
        except BaseException:
            if session is not None:
                sessions.end_turn(session, None, None, keep=True)   # a refused turn changes nothing
            raise
        # Only an interactive turn is pinned: a last turn's session ends with it.
        engine_session = session.engine_id if session is not None and body.interactive_mode else None
        shape = dict(input_tokens=len(new_tokens), history_tokens=len(history), session_id=session_id)

        def finish(stream: RequestStream | None) -> None:
            if session is None:
                return
            answer_ids = None if stream is None else answer_token_ids(stream.request, encode_answer)
            sessions.end_turn(session, prompt, answer_ids, keep=body.interactive_mode)

        try:
            streams, slot = state.start_all([(prompt, params)], FIELDS, session_id=engine_session)
        except BaseException:
            finish(None)
            raise
        stream = streams[0]
        if session is not None:
            session.running = stream

        if not body.stream:
            try:
                await state.run_to_end(streams, slot, http_request)
            finally:
                finish(stream)
            return answer(stream, stream.request.output_text, reason=finish_reason(stream.request.finish_reason),
                          **shape)

        async def lines() -> AsyncIterator[dict[str, Any]]:
            async for event in stream:
                yield answer(stream, event.text, reason=finish_reason(event.finish_reason), **shape)

        async def encoded() -> AsyncIterator[str]:
            try:
                async for item in stream_with_cleanup(streams, lines(), state, slot,
                                                      error_items=lambda error: [error.openai_body()]):
                    yield json.dumps(item, ensure_ascii=False) + "\n"
            finally:
                finish(stream)

        return StreamingResponse(encoded(), media_type="application/x-ndjson")

    def encode_answer(text: str) -> list[int]:
        # an answer cut at a stop string: short, tokenized on the event loop's own tokenizer
        return state.tokenizer(text, add_special_tokens=False).input_ids

    return router
