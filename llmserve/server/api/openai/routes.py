"""OpenAI's routes: /v1/models, /v1/completions and /v1/chat/completions, each answering in one
JSON body or as a stream of SSE chunks ending in ``data: [DONE]``."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request as HTTPRequest

from llmserve.engine.request import FinishReason
from llmserve.sampling_params import SamplingParams
from llmserve.server.api.errors import APIFields, model_not_found_error, require
from llmserve.server.api.guided import check as check_guided
from llmserve.server.api.openai.convert import (
    chat_max_tokens, chat_messages, check_model, choice_params, completion_prompt_logprobs, completion_prompts,
    openai_fields, sampling_params,
)
from llmserve.server.api.openai.render import (
    answer_delta, answer_message, chat_logprobs, completion_logprobs, echo_logprobs, finish_reason, prompt_pieces,
    usage, vllm_prompt_logprobs,
)
from llmserve.server.api.openai.schema import ChatCompletionRequest, CompletionRequest, SamplingFields
from llmserve.server.api.state import ServerState, stream_with_cleanup
from llmserve.server.api.streaming import merge_streams, sse_response
from llmserve.server.api.tools import check_tools, tool_use
from llmserve.server.engine_client import RequestStream, TokenEvent

if TYPE_CHECKING:
    import numpy as np

MAX_LOGPROBS = 20      # vLLM's limit for both completions' logprobs and chat's top_logprobs


def build_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.started_at, "owned_by": "llmserve",
                "root": state.model_path, "max_model_len": state.limits.max_model_len,
                "chat_template": state.chat_template.name if state.chat_template else None}

    def adapter_card(name: str) -> dict[str, Any]:
        # vLLM's card of a LoRA adapter: its parent is the base model
        return model_card() | {"id": name, "root": state.lora_modules[name], "parent": state.model_name}

    @router.get("/models")
    async def models():
        return {"object": "list", "data": [model_card(), *(adapter_card(name) for name in state.lora_modules)]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str):
        # any name a request's `model` may use (the served name, the path, its base name, an adapter's)
        if model_id in state.lora_modules:
            return adapter_card(model_id)
        if model_id not in state.model_names:
            raise model_not_found_error(model_id)
        return model_card()

    @router.post("/completions")
    async def completions(body: CompletionRequest, http_request: HTTPRequest):
        lora_name = check_model(state, body.model)
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
            num_prompt_tokens=sum(len(p) for p in prompts), count_output=not score_only, lora_name=lora_name,
        )

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest):
        lora_name = check_model(state, body.model)
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
            lora_name=lora_name,
        )

    return router


async def run_openai(
    state: ServerState, body: SamplingFields, http_request: HTTPRequest,
    jobs: list[tuple[list[int], SamplingParams]], fields: APIFields, *, object_name: str, chunk_object_name: str, id_prefix: str,
    full_choice: Callable[[int, RequestStream, list[TokenEvent]], dict[str, Any]],
    chunk_choice: Callable[[int, RequestStream, TokenEvent, bool], dict[str, Any]],
    num_prompt_tokens: int, count_output: bool = True, pixel_values: list[np.ndarray] | None = None,
    lora_name: str | None = None,
):
    """Start one engine request per choice, then answer in one JSON body or as a stream."""
    header = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": lora_name or state.model_name}
    if not body.stream:
        streams, all_events = await state.complete(jobs, fields, http_request, pixel_values, lora_name)
        return header | {"object": object_name,
                         "choices": [full_choice(i, s, ev) for i, (s, ev) in enumerate(zip(streams, all_events))],
                         "usage": usage(num_prompt_tokens, streams, count_output)}

    streams, slot = state.start_all(jobs, fields, pixel_values, lora_name=lora_name)
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
