"""The one admission check: what a request must satisfy before the engine takes it.

It runs once, where a request enters: the HTTP process's API edge (``ServerState.start_all``,
with the server's limits), or ``LLMEngine.new_request`` offline (``LLM.generate``,
``LLMEngine.add_request``; with the model's).
Past that point the engine trusts the request: the engine core and the scheduler only assert.
``SamplingParams`` checks its own ranges when it is made; this adds what depends on the model
and the limits. Errors are ``InvalidRequest`` in the engine's field names, which each API renders
in its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.grammar import check_guided_decoding
from llmserve.sampling_params import InvalidRequest, SamplingParams
from llmserve.worker.protocol import WorkerInfo


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_input_tokens: int      # prompt tokens
    max_model_len: int         # prompt + max_new_tokens (TGI's --max-total-tokens, vLLM's --max-model-len)
    image_token_id: int | None = None   # None: a text-only model
    tokens_per_image: int = 0
    max_images: int = 0                 # per request

    @classmethod
    def of_model(cls, info: WorkerInfo, max_model_len: int | None = None,
                 max_input_tokens: int | None = None, max_images: int | None = None) -> RequestLimits:
        """The model's limits (its context and the KV pool), tightened by an operator's if given."""
        model_limit = min(info.max_seq_len, info.max_total_token_num)
        max_len = min(max_model_len or model_limit, model_limit)
        max_input = min(max_input_tokens or max_len - 1, max_len - 1)
        if max_input < 1:
            raise ValueError(f"max_input_tokens must be >= 1 (max_model_len is {max_len})")
        images = 0 if info.image_token_id is None else max_images if max_images is not None else 1 << 30
        return cls(info.vocab_size, max_input, max_len, info.image_token_id, info.tokens_per_image, images)

    def room_for(self, num_prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may generate."""
        return max(1, self.max_model_len - num_prompt_tokens)


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits,
                  num_images: int = 0) -> None:
    """``InvalidRequest`` if the engine cannot run this request within ``limits``. The prompt is
    the one the model runs: each image's placeholder already expanded to its token count."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequest("prompt", "`prompt` has no tokens")
    vocab = limits.vocab_size
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise InvalidRequest("prompt", f"`prompt` token ids must be in [0, {vocab})")
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise InvalidRequest("stop_token_ids", f"`stop_token_ids` must be in [0, {vocab})")
    if params.guided_decoding is not None:
        check_guided_decoding(params.guided_decoding)
    if n > limits.max_input_tokens:
        raise InvalidRequest("prompt", f"`prompt` must have less than {limits.max_input_tokens + 1} tokens. Given: {n}")
    if n + params.max_new_tokens > limits.max_model_len:
        raise InvalidRequest("max_new_tokens", f"`prompt` tokens + `max_new_tokens` must be <= {limits.max_model_len}. "
                                               f"Given: {n} `prompt` tokens and {params.max_new_tokens} `max_new_tokens`")
    check_images(prompt_token_ids, num_images, limits)


def check_images(prompt_token_ids: list[int], num_images: int, limits: RequestLimits) -> None:
    """The request's images fit the model and the limit, and its prompt has exactly one run of
    placeholders for each (a stray placeholder would take features no image gave)."""
    if limits.image_token_id is None:
        if num_images:
            raise InvalidRequest("image", "this model takes text only: images are not supported")
        return
    if num_images > limits.max_images:
        raise InvalidRequest("image", f"at most {limits.max_images} image(s) per request; got {num_images}")
    placeholders = prompt_token_ids.count(limits.image_token_id)
    if placeholders != num_images * limits.tokens_per_image:
        raise InvalidRequest("prompt", f"the prompt must have one image placeholder per image: {num_images} image(s), "
                                       f"{placeholders / limits.tokens_per_image:g} placeholder(s)")
