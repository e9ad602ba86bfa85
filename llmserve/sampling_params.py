"""What a client asks of one generation: the knobs of sampling and of stopping."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A penalty divides (or multiplies) logits of up to ~1e2; outside these bounds the logits
# overflow or the penalty has no meaning left. (vLLM allows (0, 2]; TGI any positive number.)
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


@dataclass
class SamplingParams:
    """Per-request generation settings.

    ``temperature == 0`` (or ``top_k == 1``) means greedy decoding. ``logprobs`` is the number
    of most likely alternatives to report beside each sampled token's own log-probability
    (``None``: report nothing, ``0``: only the sampled token's); ``prompt_logprobs`` is the
    same for every prompt token (the first one has none: nothing precedes it).

    ``typical_p`` is locally typical sampling (HF's ``TypicalLogitsWarper``, TGI's
    ``typical_p``; 1.0: off). ``min_tokens`` is vLLM's: until that many tokens are out, EOS
    and ``stop_token_ids`` cannot be sampled and no stop rule but the length ends the request.
    """

    max_new_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.verify()

    def verify(self) -> None:
        """Raise ``ValueError`` with a one-line reason for any out-of-range setting."""
        for name in ("temperature", "top_p", "typical_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (or -1 for no limit), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}], "
                             f"got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop sequences must be non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
