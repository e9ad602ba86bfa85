"""The engine's output -> OpenAI's response pieces: finish reasons, usage, logprobs (completions',
echoed prompts', vLLM's prompt_logprobs, chat's) and the assistant's message or stream delta,
tool calls included."""

from __future__ import annotations

from typing import Any

from llmserve.detokenize import IncrementalDetokenizer
from llmserve.engine.request import FinishReason
from llmserve.output import ClientRequest
from llmserve.server.api.state import ServerState, json_logprob
from llmserve.server.api.tools import ToolUse, tool_call_json
from llmserve.server.engine_client import RequestStream, TokenEvent
from llmserve.tool_parsers import ToolCallStream


def finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage(prompt_tokens: int, streams: list[RequestStream], count_output: bool = True) -> dict:
    """``count_output`` False: a request that only scored its prompt (its one sampled token is not shown).
    ``prompt_tokens_details.cached_tokens``: the prompt tokens the engine took from its prefix
    cache (of several choices of one prompt, their share of it: ``prompt_tokens`` counts it once)."""
    completion = sum(s.request.num_output_tokens for s in streams) if count_output else 0
    generated_prompts = sum(s.request.num_prompt_tokens for s in streams)
    cached = sum(s.request.num_cached_tokens or 0 for s in streams)
    cached = cached * prompt_tokens // generated_prompts if generated_prompts else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- completions -------------------------------------------------------------------------

def completion_logprobs(state: ServerState, events: list[TokenEvent], start_offset: int) -> dict[str, Any]:
    tokens, offsets, offset = [], [], start_offset
    for e in events:
        tokens.append(state.token_text(e.token_id))
        offsets.append(offset)
        offset += len(e.text)
    return {
        "tokens": tokens,
        "token_logprobs": [json_logprob(e.logprob) for e in events],
        "top_logprobs": [{state.token_text(t): json_logprob(lp) for t, lp in e.top_logprobs or []} for e in events],
        "text_offset": offsets,
    }


def echo_logprobs(state: ServerState, request: ClientRequest) -> dict[str, Any]:
    """The prompt's part of an echoed choice's ``logprobs``, in completion_logprobs' shape: the first
    token has no logprob and no alternatives (null, as OpenAI), and each offset is where the
    token's text starts in the echoed prompt text."""
    ids = request.prompt_token_ids
    logprobs = request.prompt_logprobs or [None] * len(ids)
    tops = request.prompt_top_logprobs or [None] * len(ids)
    offsets, offset = [], 0
    for piece in prompt_pieces(state, ids):
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": [state.token_text(t) for t in ids],
        "token_logprobs": [json_logprob(lp) for lp in logprobs],
        "top_logprobs": [None if top is None else {state.token_text(t): json_logprob(lp) for t, lp in top} for top in tops],
        "text_offset": offsets,
    }


def prompt_pieces(state: ServerState, ids: list[int]) -> list[str]:
    """Each prompt token's share of ``state.tokenizer.decode(ids)`` (the echoed text), in one pass."""
    detokenizer = IncrementalDetokenizer(state.tokenizer, skip_special_tokens=False)
    return [detokenizer.step(t) for t in ids]


def vllm_prompt_logprobs(state: ServerState, request: ClientRequest) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), its own logprob and its
    top alternatives, keyed by token id. ``rank`` is known for the alternatives only (1 = most
    likely); a prompt token outside them has ``rank`` null."""
    out: list[dict[str, Any] | None] = []
    tops = request.prompt_top_logprobs or [None] * request.num_prompt_tokens
    for token_id, logprob, top in zip(request.prompt_token_ids, request.prompt_logprobs or [], tops):
        if logprob is None:
            out.append(None)
            continue
        entries = {str(t): {"logprob": json_logprob(lp), "rank": rank, "decoded_token": state.token_text(t)}
                   for rank, (t, lp) in enumerate(top or [], start=1)}
        entries.setdefault(str(token_id), {"logprob": json_logprob(logprob), "rank": None,
                                           "decoded_token": state.token_text(token_id)})
        out.append(entries)
    return out


# -- chat --------------------------------------------------------------------------------

def chat_logprobs(state: ServerState, events: list[TokenEvent]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
        text = state.token_text(token_id)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode())}

    return {"content": [entry(e.token_id, e.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in e.top_logprobs or []]}
                        for e in events]}


def answer_message(text: str, reason: str | None, tools: ToolUse | None) -> tuple[dict[str, Any], str | None]:
    """A whole answer as OpenAI's message, and its finish_reason ("tool_calls" when it calls)."""
    if tools is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = tools.parse(text)
    if not calls:
        return {"role": "assistant", "content": content}, reason
    message = {"role": "assistant", "content": content, "tool_calls": [tool_call_json(c) for c in calls]}
    return message, "tool_calls" if reason == "stop" else reason


def answer_delta(stream: ToolCallStream, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """One event's text through the choice's tool-call parser: the content and calls that became
    certain (a call is sent whole, once its JSON is complete), and the finish_reason."""
    first_index = stream.sent_calls
    content, calls = stream.feed(text, final=reason is not None)
    delta: dict[str, Any] = {"content": content} if content or not calls else {}
    if calls:
        delta["tool_calls"] = [tool_call_json(c, first_index + k) for k, c in enumerate(calls)]
    if reason == "stop" and stream.sent_calls:
        reason = "tool_calls"
    return delta, reason
