"""What a client asks of one generation: the knobs of sampling and of stopping."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_FIELD = re.compile(r"`(\w+)`")


class InvalidRequest(ValueError):
    """A request the engine will not run: why, and which field is to blame.

    Fields go by the engine's names (``prompt``, ``max_new_tokens``, ``logprobs``, ...), written
    in backquotes in the message; each API renders the message with its own names for them
    (``render``: OpenAI's ``max_tokens``, TGI's ``inputs``), so the rules live here once and
    the APIs only translate.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(self.render())

    def render(self, names: Mapping[str, str] | None = None, quote: bool = False) -> str:
        """The message, each `field` under the API's name for it (backquoted if ``quote``)."""
        names = names or {}

        def name(m: re.Match) -> str:
            n = names.get(m[1], m[1])
            return f"`{n}`" if quote else n
        return _FIELD.sub(name, self.message)


@dataclass(frozen=True)
class Range:
    """The values one sampling number may take: from ``low`` up to ``high`` (None: no upper bound),
    each end included unless open; ``integer``: whole numbers only. ``note`` ends its message."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    note: str = ""

    def __contains__(self, value: Any) -> bool:
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, int):
                return False
        elif not _is_finite_number(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.high is not None:
            text = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif self.low == 0 and self.low_open:
            text = "positive"
        else:
            text = f"{'>' if self.low_open else '>='} {low}"
        text = f"an integer {text}" if self.integer else text
        return f"{text} ({self.note})" if self.note else text


@dataclass(frozen=True)
class SamplingRule:
    """One sampling number's range in SamplingParams, and where an API's own documentation narrows
    it, the changes that API makes to it (``{"high_open": True}``), so that they follow the rule.
    An API checks its range before SamplingParams checks the rule's: a change never widens it."""

    range: Range
    narrowed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def range_for(self, api: str) -> Range:
        return dataclasses.replace(self.range, **self.narrowed[api])


# torch seeds are unsigned 64-bit, and so are both APIs' (OpenAI's and TGI's); the sampler holds
# top_k in an integer tensor, and beyond any vocabulary a top_k cuts nothing anyway.
MAX_SEED = 2**64 - 1
MAX_TOP_K = 2**31 - 1

# Every sampling number's range, written once. SamplingParams checks its values against it, and
# with them what the offline LLM, both APIs and a model's or chat template's defaults give it; an
# API checks a request's value first where its documentation narrows the range (OpenAI caps the
# temperature at 2; TGI's seed 004 refuses top_p 1.0 and top_k 0, its "unset" values, a
# temperature of 0 and a seed of 0).
SAMPLING_RULES: dict[str, SamplingRule] = {
    "temperature": SamplingRule(Range(0), {"openai": {"high": 2}, "tgi": {"low_open": True}}),
    "top_p": SamplingRule(Range(0, 1, low_open=True), {"tgi": {"high_open": True}}),
    "top_k": SamplingRule(Range(0, MAX_TOP_K, integer=True, note="0: no cut"),
                          {"tgi": {"low_open": True, "note": ""}}),
    "typical_p": SamplingRule(Range(0, 1, low_open=True)),
    # A penalty divides (or multiplies) logits of up to ~1e2; outside these bounds the logits
    # overflow or the penalty has no meaning left. (vLLM allows (0, 2]; TGI any positive number.)
    "repetition_penalty": SamplingRule(Range(0.01, 100.0)),
    "presence_penalty": SamplingRule(Range(-2, 2)),
    "frequency_penalty": SamplingRule(Range(-2, 2)),
    "seed": SamplingRule(Range(0, MAX_SEED, integer=True), {"tgi": {"low_open": True}}),
}


def check_ranges(values: Mapping[str, Any], api: str | None = None) -> None:
    """``InvalidRequest`` for the first of ``values`` outside its range in SAMPLING_RULES. With
    ``api``: a request's values as they came (None: unset), checked only where that API narrows the
    range; SamplingParams checks the rest once the request is resolved."""
    for name, value in values.items():
        rule = SAMPLING_RULES[name]
        if api is None:
            allowed = rule.range
        elif api in rule.narrowed and value is not None:
            allowed = rule.range_for(api)
        else:
            continue
        if value not in allowed:
            kind = allowed if allowed.integer or _is_finite_number(value) else "a finite number"
            raise InvalidRequest(name, f"`{name}` must be {kind}, got {value!r}")


def _is_finite_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _number(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Constrain a generation to a language: exactly one of the fields is set (vLLM's names).

    ``json`` is a JSON schema serialised as text (so it pickles and hashes, and compiled
    grammars can be cached by it); ``json_object`` asks for any JSON object; ``regex`` a
    regular expression the whole output must match; ``choice`` one of a few strings;
    ``grammar`` an EBNF grammar in the grammar library's dialect.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        set_fields += ["json_object"] if self.json_object else []
        _require(len(set_fields) == 1, "guided_decoding",
                 f"`guided_decoding` takes exactly one of json, json_object, regex, choice, grammar; got {set_fields or 'none'}")
        _require(self.choice is None or (len(self.choice) > 0 and all(isinstance(c, str) and c for c in self.choice)),
                 "guided_decoding", "`guided_decoding` choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


@dataclass
class SamplingParams:
    """Per-request generation settings.

    ``temperature == 0`` (or ``top_k == 1``) means greedy decoding. ``logprobs`` is the number
    of most likely alternatives to report beside each sampled token's own log-probability
    (``None``: report nothing, ``0``: only the sampled token's); ``prompt_logprobs`` is the
    same for every prompt token (the first one has none: nothing precedes it).

    ``guided_decoding`` constrains the output to a grammar (JSON schema, regex, choice, EBNF).

    ``typical_p`` is locally typical sampling (HF's ``TypicalLogitsWarper``, TGI's
    ``typical_p``; 1.0: off). ``min_tokens`` is vLLM's: until that many tokens are out, EOS
    and ``stop_token_ids`` cannot be sampled and no stop rule but the length ends the request.

    ``speculate``: whether the request may take prompt-lookup drafts when the server runs with
    ``--speculate K`` (False: it decodes one token per step, whatever the server's setting).
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
    guided_decoding: GuidedDecodingParams | None = None
    speculate: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.verify()

    def verify(self) -> None:
        """Raise ``InvalidRequest`` with a one-line reason for any out-of-range setting."""
        check_ranges({name: getattr(self, name) for name in SAMPLING_RULES if name != "seed" or self.seed is not None})
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens",
                 f"`max_new_tokens` must be a positive integer, got {self.max_new_tokens!r}")
        _require(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_new_tokens, "min_tokens",
                 f"`min_tokens` must be an integer in [0, `max_new_tokens`={self.max_new_tokens}], got {self.min_tokens!r}")
        _require(self.logprobs is None or self.logprobs >= 0, "logprobs", f"`logprobs` must be >= 0, got {self.logprobs}")
        _require(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
                 f"`prompt_logprobs` must be >= 0, got {self.prompt_logprobs}")
        _require(all(self.stop), "stop", "`stop` sequences must be non-empty strings")
        _require(isinstance(self.speculate, bool), "speculate", f"`speculate` must be true or false, got {self.speculate!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise InvalidRequest(field, message)
