"""OpenAI's interface: /v1/models, /v1/completions and /v1/chat/completions.

Field names, defaults and response shapes are OpenAI's; the extra sampling fields vLLM users
rely on (top_k, repetition_penalty, ignore_eos, min_tokens, stop_token_ids) are accepted too.
Streams are SSE chunks ending in ``data: [DONE]``.

- ``schema``: the request bodies;
- ``convert``: a request -> its prompts and each choice's SamplingParams;
- ``render``: the engine's output -> OpenAI's choices, logprobs and usage;
- ``routes``: the routes, which put the three together.
"""

from llmserve.server.api.openai.routes import build_router

__all__ = ["build_router"]
