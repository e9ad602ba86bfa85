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
    max_total_tokens: int      # prompt + max_new_tokens

    @classmethod
    def of_model(cls, info: WorkerInfo, max_total_tokens: int | None = None,
                 max_input_tokens: int | None = None) -> RequestLimits:
        """The model's limits (its context and the KV pool), tightened by an operator's if given."""
        model_limit = min(info.max_seq_len, info.max_total_token_num)
        max_total = min(max_total_tokens or model_limit, model_limit)
        max_input = min(max_input_tokens or max_total - 1, max_total - 1)
        if max_input < 1:
            raise ValueError(f"max_input_tokens must be >= 1 (max_total_tokens is {max_total})")
        return cls(info.vocab_size, max_input, max_total)

    def room_for(self, num_prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may generate."""
        return max(1, self.max_total_tokens - num_prompt_tokens)


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """``InvalidRequest`` if the engine cannot run this request within ``limits``."""
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
    if n + params.max_new_tokens > limits.max_total_tokens:
        raise InvalidRequest("max_new_tokens", f"`prompt` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
                                               f"Given: {n} `prompt` tokens and {params.max_new_tokens} `max_new_tokens`")
