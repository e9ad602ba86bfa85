"""OpenAI's request bodies: /v1/completions' and /v1/chat/completions' (and the sampling fields
/v1/chat/interactive shares). Field names and defaults are OpenAI's, plus the extra sampling
fields vLLM users rely on (top_k, repetition_penalty, ignore_eos, min_tokens, stop_token_ids)."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from llmserve.server.api.schema import APIModel, ImageURL
from llmserve.server.api.tools import Tool, ToolCall, ToolChoice

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


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
