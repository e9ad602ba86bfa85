"""What the sampler keeps per request (``RequestState``): its parameters, the penalties' token
counts, its seed and random stream, the ids min_tokens bans, its grammar matcher; and a snapshot
of the random stream (``RandomState``), so that a failed attempt can be retried from where it began.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance

# Below this temperature, logits / temperature can overflow float32 and softmax returns
# NaN; such a request is sampled greedily instead (which is what T -> 0 tends to anyway).
_MIN_TEMPERATURE = 1e-5


@dataclass
class RequestState:
    params: SamplingParams
    # One entry per distinct token of prompt + output, mapped to how often it occurs in
    # the OUTPUT (0 for a token seen only in the prompt): exactly what the penalty kernel
    # wants, kept up to date at O(1) per sampled token.
    token_counts: dict[int, int]
    seed: int
    # Token ids that may not be sampled before min_tokens tokens are out: EOS and stop ids.
    min_tokens_banned: list[int]
    # Tokens sampled so far. The state outlives a preemption, so this is the output length
    # the request has reached, however often it was prefilled.
    num_sampled: int = 0
    # Created on first use, because only then do we know the device of the logits.
    generator: torch.Generator | None = field(default=None)
    # Where the request stands in its grammar (guided_decoding), or None: unconstrained. Like
    # the counts it outlives a preemption, so a re-prefilled request goes on where it was.
    matcher: llguidance.LLMatcher | None = None

    @property
    def is_greedy(self) -> bool:
        return self.params.is_greedy or self.params.temperature < _MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    @property
    def below_min_tokens(self) -> bool:
        return self.num_sampled < self.params.min_tokens

    def generator_on(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        return self.generator


@dataclass
class RandomState:
    """A request's random stream as it was before an attempt, so that an attempt that failed
    part-way (some rows drawn, then an error) does not advance it twice."""
    request: RequestState
    generator_state: torch.Tensor | None

    @classmethod
    def save(cls, state: RequestState) -> RandomState:
        return cls(state, None if state.generator is None else state.generator.get_state())

    def restore(self) -> None:
        if self.generator_state is None:
            self.request.generator = None    # created on first use: the next use re-seeds it
        else:
            self.request.generator.set_state(self.generator_state)
