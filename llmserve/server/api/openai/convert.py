"""An OpenAI request -> what the engine runs: its prompts (text, token ids, a conversation through
the chat template) and the SamplingParams of each choice. Checked here: what is OpenAI's own; the
engine's rules are SamplingParams' and check_request's, rendered in OpenAI's field names."""

from __future__ import annotations

import dataclasses
from typing import Any

from llmserve.chat_template import BaseTemplate, StopWords
from llmserve.sampling_params import InvalidRequest, SamplingParams
from llmserve.server.api.errors import APIFields, model_not_found_error, require, template_error, validation_error
from llmserve.server.api.guided import openai_guided_decoding
from llmserve.server.api.openai.schema import ChatMessage, CompletionRequest, SamplingFields
from llmserve.server.api.schema import check_stop, image_url_of, stop_list
from llmserve.server.api.state import ServerState, fresh_seed
from llmserve.server.api.tools import check_tool_messages, template_tool_calls

MAX_N = 128
MAX_STOP_TOKEN_IDS = 1024

# Clients that do not know the served name send a placeholder: huggingface_hub's InferenceClient
# sends "dummy" with a base URL, TGI's docs use "tgi". TGI itself ignores the field.
MODEL_PLACEHOLDERS = frozenset({"tgi", "dummy"})
# OpenAI's message roles; which of them a conversation may use is the chat template's business.
OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def check_model(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's ``model`` names (None: the base model); 404 for a name that is
    neither the model's nor an adapter's."""
    if model in state.lora_modules:
        return model
    if model is not None and model not in state.model_names and model not in MODEL_PLACEHOLDERS:
        raise model_not_found_error(model)
    return None


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
