"""OpenAI's interface: /v1/models, /v1/completions and /v1/chat/completions.

Field names, defaults and response shapes are OpenAI's; the extra sampling fields vLLM users
rely on (top_k, repetition_penalty, ignore_eos, min_tokens, stop_token_ids) are accepted too.
Streams are SSE chunks ending in ``data: [DONE]``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request as HTTPRequest
from pydantic import ConfigDict, Field

from llmserve.chat_template import BaseTemplate, StopWords
from llmserve.sampling_params import InvalidRequest, SamplingParams
from llmserve.server.api.errors import APIFields, model_not_found_error, require, template_error, validation_error
from llmserve.server.api.guided import check as check_guided, openai_guided_decoding
from llmserve.server.api.schema import APIModel, ImageURL, check_stop, image_url_of, stop_list
from llmserve.server.api.state import ServerState, fresh_seed, json_logprob, stream_with_cleanup
from llmserve.server.api.streaming import merge_streams, sse_response
from llmserve.server.api.tools import (
    Tool, ToolCall, ToolChoice, ToolUse, check_tool_messages, check_tools, template_tool_calls, tool_call_json, tool_use,
)
from llmserve.detokenize import IncrementalDetokenizer
from llmserve.engine.request import FinishReason
from llmserve.output import ClientRequest
from llmserve.server.engine_client import RequestStream, TokenEvent
from llmserve.tool_parsers import ToolCallStream

if TYPE_CHECKING:
    import numpy as np

MAX_N = 128
MAX_LOGPROBS = 20      # vLLM's limit for both completions' logprobs and chat's top_logprobs
MAX_STOP_TOKEN_IDS = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions

# Clients that do not know the served name send a placeholder: huggingface_hub's InferenceClient
# sends "dummy" with a base URL, TGI's docs use "tgi". TGI itself ignores the field.
MODEL_PLACEHOLDERS = frozenset({"tgi", "dummy"})
# OpenAI's message roles; which of them a conversation may use is the chat template's business.
OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class StreamOptions(APIModel):
    include_usage: bool = False


class SamplingFields(APIModel):
    """What both endpoints share."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    # Structured output (guided.py): OpenAI's response_format, or one of vLLM's extras.
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # ours: false keeps this request off prompt-lookup drafts (--speculate)
    speculate: bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = None       # vLLM's: each prompt token's logprob and its top alternatives


class ContentPart(APIModel):
    """One part of a message's content: text, or an image (``image_url``, for a model that takes images)."""
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    image_url: str | ImageURL | None = None     # OpenAI's object; a bare URL string as some clients send


class ChatMessage(APIModel):
    model_config = ConfigDict(extra="allow")   # name, tool_call_id, ... go to the template as they are

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None          # OpenAI's deprecated spelling of tools: refused, not ignored
    function_call: Any = None


# -- requests -> SamplingParams ----------------------------------------------------------

def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names and model not in MODEL_PLACEHOLDERS:
        raise model_not_found_error(model)


def openai_fields(prompt_param: str, max_tokens_param: str, logprobs_param: str) -> APIFields:
    # an image's faults are its message's (OpenAI's `param` names a top-level field)
    return APIFields({"prompt": prompt_param, "image": prompt_param, "max_new_tokens": max_tokens_param,
                      "logprobs": logprobs_param})


def sampling_params(body: SamplingFields, state: ServerState, num_prompt_tokens: int, max_tokens: int | None,
                    logprobs: int | None, fields: APIFields,
                    defaults: BaseTemplate | None = None, template_stop: StopWords = StopWords()) -> SamplingParams:
    """The shared OpenAI fields -> SamplingParams for one choice (the caller varies the seed). A
    chat template's sampling fields fill in what the request and the model leave unset, and its
    stop words join the request's. Checked here: what is OpenAI's own (its limits, the fields it
    does not support); the ranges of sampling numbers (SAMPLING_RULES, with OpenAI's narrower
    ones) and the engine's rules are SamplingParams' and check_request's, rendered in OpenAI's
    field names."""
    require(1 <= body.n <= MAX_N, f"n must be in [1, {MAX_N}], got {body.n}", "n")
    require(not body.logit_bias, "logit_bias is not supported", "logit_bias")
    require(len(body.stop_token_ids or []) <= MAX_STOP_TOKEN_IDS,
           f"stop_token_ids supports up to {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    stop = stop_list(body.stop)
    check_stop(stop)
    if max_tokens is None:            # as much as fits, like vLLM
        max_tokens = state.room_for(num_prompt_tokens)
    guided_decoding, _ = openai_guided_decoding(body)
    try:
        sampling = state.sampling_fields("openai", {
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
            "repetition_penalty": body.repetition_penalty, "seed": body.seed}, defaults)
        return template_stop.add_to(SamplingParams(
            **sampling, max_new_tokens=max_tokens,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            seed=body.seed if body.seed is not None else (fresh_seed() if sampling["temperature"] > 0 else None),
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, stop=stop,
            stop_token_ids=list(body.stop_token_ids or []), logprobs=logprobs, guided_decoding=guided_decoding,
            speculate=body.speculate,
        ))
    except InvalidRequest as e:
        raise fields.error(e) from None


def completion_prompt_logprobs(body: CompletionRequest) -> int | None:
    """How many alternatives the engine reports per prompt token: echo with logprobs wants the
    prompt's logprobs as OpenAI shows them, vLLM's prompt_logprobs its own; None: neither."""
    wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    return max(wanted) if wanted else None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n choices of one prompt: the same settings, each its own random stream (seed + i), so a
    seeded request is reproducible and its choices still differ."""
    if n == 1:
        return [params]
    return [dataclasses.replace(params, seed=None if params.seed is None else (params.seed + i) % 2**64)
            for i in range(n)]


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

async def completion_prompts(body: CompletionRequest, state: ServerState) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    require(len(prompt) > 0, "prompt must not be empty", "prompt")
    # Each prompt x choice is a generation with a concurrency slot: refuse a list that can never
    # be admitted before tokenizing any of it.
    generations = len(prompt) * body.n
    limit = state.limits.max_concurrent_requests
    require(generations <= limit, f"the request asks for {generations} generations (prompts x n); this server runs "
                                 f"at most {limit} at once (--max-concurrent-requests)", "prompt")
    return [await state.tokenize_in_thread(state.encode, p, "prompt") if isinstance(p, str) else list(p) for p in prompt]


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

def message_content(message: ChatMessage, image_urls: list[str]) -> str | list[dict[str, str]]:
    """What the chat template gets as a message's content: its text, or, when it has image parts,
    its parts with each image as ``{"type": "image"}`` (what HF processors' templates expect;
    registry templates render their placeholder there). The images' URLs go to ``image_urls``."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts: list[dict[str, str]] = []
    for part in message.content:
        if part.type == "image_url":
            if part.image_url is None:
                raise validation_error("a content part of type 'image_url' needs an `image_url`", "messages")
            image_urls.append(image_url_of(part.image_url))
            parts.append({"type": "image"})
        elif part.type != "text":
            raise validation_error(f"content part of type {part.type!r} is not supported by this model", "messages")
        elif part.text is None:
            raise validation_error("a content part of type 'text' needs a `text` string", "messages")
        else:
            parts.append({"type": "text", "text": part.text})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def chat_messages(messages: list[ChatMessage], param: str = "messages") -> tuple[list[dict[str, Any]], list[str]]:
    """The conversation for the chat template, and the URLs of its images in order."""
    for m in messages:
        if m.role not in OPENAI_ROLES:
            raise template_error(f"unknown role {m.role!r}: a message's role is one of {', '.join(sorted(OPENAI_ROLES))}",
                                 param)
    check_tool_messages(messages)
    image_urls: list[str] = []
    return [template_message(m, image_urls) for m in messages], image_urls


def template_message(message: ChatMessage, image_urls: list[str]) -> dict[str, Any]:
    """A message as chat templates take it: its content (never None; see message_content, which
    adds its images' URLs to ``image_urls``), calls with object arguments."""
    fields = message.model_dump(exclude_none=True) | {"content": message_content(message, image_urls)}
    if message.tool_calls is not None:
        fields["tool_calls"] = template_tool_calls(message.tool_calls)
    return fields


def chat_max_tokens(state: ServerState, num_prompt_tokens: int, max_tokens: int | None, param: str,
                    prompt_param: str = "messages") -> int | None:
    """The chat template's session_len bounds the conversation and its answer together; an unset
    max_tokens becomes what is left of it."""
    template = state.chat_template
    session_len = template.template.session_len
    if session_len is None:
        return max_tokens
    if num_prompt_tokens >= session_len:
        raise template_error(f"the conversation is {num_prompt_tokens} tokens, but the {template.name} chat template "
                             f"allows {session_len} (session_len) for the conversation and its answer together",
                             prompt_param)
    if max_tokens is None:
        return min(state.room_for(num_prompt_tokens), session_len - num_prompt_tokens)
    if num_prompt_tokens + max_tokens > session_len:
        raise template_error(f"the conversation ({num_prompt_tokens} tokens) and `{param}` ({max_tokens}) exceed "
                             f"the {template.name} chat template's session_len of {session_len}", param)
    return max_tokens


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


# -- routes ------------------------------------------------------------------------------

def build_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.started_at, "owned_by": "llmserve",
                "root": state.model_path, "max_model_len": state.limits.max_total_tokens,
                "chat_template": state.chat_template.name if state.chat_template else None}

    @router.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str):
        # any name a request's `model` may use (the served name, the path, its base name)
        if model_id not in state.model_names:
            raise model_not_found_error(model_id)
        return model_card()

    @router.post("/completions")
    async def completions(body: CompletionRequest, http_request: HTTPRequest):
        check_model(state, body.model)
        require(body.suffix is None, "suffix is not supported", "suffix")
        require(body.best_of in (None, 1), "best_of > 1 is not supported", "best_of")
        require(body.logprobs is None or 0 <= body.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
        require(body.prompt_logprobs is None or 0 <= body.prompt_logprobs <= MAX_LOGPROBS,
               f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
        # max_tokens 0 with echo scores the prompt (lm-eval's loglikelihood requests): the
        # engine still samples the one token a prefill yields, which the answer leaves out.
        score_only = body.max_tokens == 0
        require(not score_only or body.echo, "max_tokens must be at least 1, or 0 with echo to score the prompt only",
               "max_tokens")
        prompts = await completion_prompts(body, state)
        fields = openai_fields("prompt", "max_tokens", "logprobs")
        prompt_logprobs = completion_prompt_logprobs(body)
        params = [choice_params(dataclasses.replace(
            sampling_params(body, state, len(p), 1 if score_only else body.max_tokens, body.logprobs, fields),
            prompt_logprobs=prompt_logprobs), body.n) for p in prompts]
        prompt_texts = ["".join(prompt_pieces(state, p)) for p in prompts] if body.echo else None

        def make_choice(i: int, s: RequestStream, text: str, events: list[TokenEvent], reason: FinishReason | None,
                        first: bool) -> dict[str, Any]:
            echo = prompt_texts is not None and first
            if score_only:
                text, events = "", []
            logprobs = None
            if body.logprobs is not None:
                start = len(prompt_texts[i // body.n]) if prompt_texts else 0
                logprobs = completion_logprobs(state, events, start)
                if echo:
                    logprobs = {k: v + logprobs[k] for k, v in echo_logprobs(state, s.request).items()}
            choice = {"index": i, "text": prompt_texts[i // body.n] + text if echo else text, "logprobs": logprobs,
                      "finish_reason": finish_reason(reason), "stop_reason": None}
            if body.prompt_logprobs is not None and first:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(state, s.request)
            return choice

        return await run_openai(
            state, body, http_request, [(p, cp) for p, ps in zip(prompts, params) for cp in ps], fields,
            object_name="text_completion", chunk_object_name="text_completion", id_prefix="cmpl",
            full_choice=lambda i, s, events: make_choice(i, s, s.request.output_text, events, s.request.finish_reason, True),
            chunk_choice=lambda i, s, e, first: make_choice(i, s, e.text, [e], e.finish_reason, first),
            num_prompt_tokens=sum(len(p) for p in prompts), count_output=not score_only,
        )

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest):
        check_model(state, body.model)
        require(body.top_logprobs is None or 0 <= body.top_logprobs <= MAX_LOGPROBS,
               f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        require(body.top_logprobs is None or body.logprobs, "top_logprobs requires logprobs to be true", "top_logprobs")
        for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
            require(getattr(body, legacy) is None, f"`{legacy}` is deprecated and not served: use `{current}`", legacy)
        check_tools(body.tools, body.tool_choice)
        tools = tool_use(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_parser)
        messages, image_urls = chat_messages(body.messages)
        require(not image_urls or state.takes_images,
               "content part of type 'image_url' is not supported by this model: it takes text only", "messages")
        pixel_values = await state.load_images(image_urls, openai_fields("messages", "max_tokens", "top_logprobs"))
        prompt = state.expand_images(await state.tokenize_in_thread(state.encode_chat, messages,
                                                                    tools.tools if tools else None))
        if body.max_completion_tokens is not None:
            max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = body.max_tokens, "max_tokens"
        max_tokens = chat_max_tokens(state, len(prompt), max_tokens, param)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        fields = openai_fields("messages", param, "top_logprobs")
        params = sampling_params(body, state, len(prompt), max_tokens, logprobs, fields,
                                 defaults=state.chat_template.template, template_stop=state.chat_stop)
        if tools is not None and tools.guided_decoding is not None:
            require(params.guided_decoding is None, "tool_choice \"required\" or a named function constrains the "
                   "answer itself: it cannot be combined with response_format or guided_*", "tool_choice")
            check_guided(tools.guided_decoding, "tools")
            params = dataclasses.replace(params, guided_decoding=tools.guided_decoding)
        params = choice_params(params, body.n)

        def full_choice(i: int, s: RequestStream, events: list[TokenEvent]) -> dict[str, Any]:
            message, reason = answer_message(s.request.output_text, finish_reason(s.request.finish_reason), tools)
            return {"index": i, "message": message, "logprobs": chat_logprobs(state, events) if body.logprobs else None,
                    "finish_reason": reason}

        answer_streams = [tools.stream() for _ in params] if tools is not None else None

        def chunk_choice(i: int, s: RequestStream, e: TokenEvent, first: bool) -> dict[str, Any]:
            reason = finish_reason(e.finish_reason)
            if answer_streams is None:
                delta = {"content": e.text}
            else:
                delta, reason = answer_delta(answer_streams[i], e.text, reason)
            delta = {"role": "assistant"} | delta if first else delta
            return {"index": i, "delta": delta, "logprobs": chat_logprobs(state, [e]) if body.logprobs else None,
                    "finish_reason": reason}

        return await run_openai(
            state, body, http_request, [(prompt, p) for p in params], fields, object_name="chat.completion",
            chunk_object_name="chat.completion.chunk", id_prefix="chatcmpl",
            full_choice=full_choice, chunk_choice=chunk_choice, num_prompt_tokens=len(prompt), pixel_values=pixel_values,
        )

    return router


async def run_openai(
    state: ServerState, body: SamplingFields, http_request: HTTPRequest,
    jobs: list[tuple[list[int], SamplingParams]], fields: APIFields, *, object_name: str, chunk_object_name: str, id_prefix: str,
    full_choice: Callable[[int, RequestStream, list[TokenEvent]], dict[str, Any]],
    chunk_choice: Callable[[int, RequestStream, TokenEvent, bool], dict[str, Any]],
    num_prompt_tokens: int, count_output: bool = True, pixel_values: list[np.ndarray] | None = None,
):
    """Start one engine request per choice, then answer in one JSON body or as a stream."""
    header = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    if not body.stream:
        streams, all_events = await state.complete(jobs, fields, http_request, pixel_values)
        return header | {"object": object_name,
                         "choices": [full_choice(i, s, ev) for i, (s, ev) in enumerate(zip(streams, all_events))],
                         "usage": usage(num_prompt_tokens, streams, count_output)}

    streams, slot = state.start_all(jobs, fields, pixel_values)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    chunk_header = header | {"object": chunk_object_name}

    async def chunks() -> AsyncIterator[dict[str, Any] | str]:
        started = [False] * len(streams)
        async for i, event in merge_streams(streams):
            chunk = chunk_header | {"choices": [chunk_choice(i, streams[i], event, not started[i])]}
            started[i] = True
            yield chunk | ({"usage": None} if include_usage else {})
        if include_usage:
            yield chunk_header | {"choices": [], "usage": usage(num_prompt_tokens, streams, count_output)}
        yield "[DONE]"

    return sse_response(stream_with_cleanup(streams, chunks(), state, slot,
                                            error_items=lambda error: [error.openai_body(), "[DONE]"]))
