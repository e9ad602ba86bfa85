"""The model's recommended sampling defaults: what a request's unset sampling fields become.

A model's authors put the sampling they recommend in its ``generation_config.json``
(Llama 3: temperature 0.6, top_p 0.9). vLLM applies those values wherever a request leaves a
field unset (its ``--generation-config``: ``auto``, ``vllm`` or a folder); we do the same, with
``--generation-config {auto,none,vllm,PATH}``:

- ``auto`` (default): the model directory's ``generation_config.json``; for a ``.gguf`` file one
  next to it, else the embedded model's model-card values (see ``_KNOWN_GGUF_DEFAULTS``).
- ``none`` or ``vllm`` (vLLM's spelling): nothing set; each API keeps its own defaults.
- a folder holding a ``generation_config.json`` (or the file itself).

Only the fields the file itself contains count: the file is read as plain JSON rather than
through ``transformers.GenerationConfig``, whose class defaults (``top_k=50`` before
transformers 5) would otherwise look like the authors' choice. Only the fields our
``SamplingParams`` implements are taken (``min_p``, ``max_new_tokens`` ... are ignored).

``do_sample``: in HF ``generate``, ``do_sample: false`` makes decoding greedy and the sampling
fields unused (HF warns about such a file). Like vLLM we ignore ``do_sample`` and take the
sampling fields the file sets as defaults: they are what the authors tuned, and whether a
request samples is each API's own rule (OpenAI: the temperature; TGI: ``do_sample`` or a
warper in the request). A file with ``do_sample: false`` and no sampling field sets nothing.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from llmserve.common.errors import ModelLoadError
from llmserve.default_model import DEFAULT_MODEL_NAME, default_model_path
from llmserve.sampling_params import SamplingParams, check_ranges

if TYPE_CHECKING:
    from llmserve.chat_template import BaseTemplate

__all__ = ["GENERATION_CONFIG_FILE", "GenerationConfigError", "SamplingDefaults", "load_sampling_defaults"]

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
AUTO = "auto"
NONE_SPECS = ("none", "vllm")   # vLLM's "vllm" means its own (the API's) defaults: no model defaults


class GenerationConfigError(ValueError):
    """A --generation-config that cannot be used; the message is one line saying why."""


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for the sampling fields a request leaves unset; ``None``: not set (the API's own
    default applies). ``source`` says where they came from, for /info and the start-up line."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    source: str = "none"

    def __post_init__(self) -> None:
        check_ranges(self.values())      # SamplingParams' ranges

    def get(self, name: str, fallback: Any) -> Any:
        """The model's default for sampling field ``name``, else ``fallback`` (the API's own)."""
        value = getattr(self, name)
        return fallback if value is None else value

    def resolve(self, request: Mapping[str, Any], template: BaseTemplate | None = None) -> dict[str, Any]:
        """The sampling fields for SamplingParams, each from the first of: the request (``request``'s
        value; None or absent: unset), the model's recommended value (these defaults), the chat
        template's (``template``, on chat routes), the API's default (``API_DEFAULTS``). Every API
        and the offline LLM fill what a request leaves unset here and nowhere else."""
        return {name: next((v for v in (request.get(name), getattr(self, name), getattr(template, name, None))
                            if v is not None), API_DEFAULTS[name])
                for name in SAMPLING_FIELDS}

    def values(self) -> dict[str, float | int]:
        """The fields that are set, e.g. ``{"temperature": 0.2, "top_p": 0.9}``."""
        return {k: v for k, v in asdict(self).items() if k != "source" and v is not None}

    def describe(self) -> dict[str, Any]:
        """For /info: the source and every field (``None`` where unset)."""
        return asdict(self)

    def summary(self) -> str:
        """One phrase for the start-up line: ``temperature=0.2, top_p=0.9 (from ...)``."""
        values = ", ".join(f"{k}={v:g}" for k, v in self.values().items())
        return f"{values} ({self.source})" if values else f"none ({self.source})"


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingDefaults) if f.name != "source")
# What a field none of the request, the model and the chat template sets becomes: the API's
# default, which for both APIs and the offline LLM is SamplingParams' own (temperature 1, top_p 1,
# top_k 0: no cut, typical_p 1, repetition_penalty 1).
API_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(SamplingParams) if f.name in SAMPLING_FIELDS}

# GGUF files carry no generation_config.json. The embedded SmolLM2-135M-Instruct's model card
# (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct, "How to use") samples with
# `model.generate(inputs, max_new_tokens=50, temperature=0.2, top_p=0.9, do_sample=True)`; the
# repository's own generation_config.json sets only bos/eos/pad token ids.
_KNOWN_GGUF_DEFAULTS: dict[str, dict[str, float]] = {
    DEFAULT_MODEL_NAME: {"temperature": 0.2, "top_p": 0.9},
}


def load_sampling_defaults(spec: str, model_path: str) -> SamplingDefaults:
    """``spec`` is the --generation-config value; ``model_path`` the resolved model directory or
    .gguf file. Raises ``GenerationConfigError`` for a missing or bad file or value."""
    if spec in NONE_SPECS:
        return SamplingDefaults(source=spec)
    if not spec:
        raise GenerationConfigError("--generation-config must be 'auto', 'none', 'vllm' or a folder, got ''")
    if spec == AUTO:
        return _auto_defaults(model_path)
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isdir(path):
        path = os.path.join(path, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        raise GenerationConfigError(f"--generation-config {spec!r}: no {GENERATION_CONFIG_FILE} there "
                                    f"(expected 'auto', 'none', 'vllm', or a folder holding {GENERATION_CONFIG_FILE})")
    return _read_file(path)


def _auto_defaults(model_path: str) -> SamplingDefaults:
    folder = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if os.path.isfile(path):
        return _read_file(path)
    if model_path.endswith(".gguf") and _is_embedded_model(model_path):
        return SamplingDefaults(**_KNOWN_GGUF_DEFAULTS[DEFAULT_MODEL_NAME],
                                source=f"the {DEFAULT_MODEL_NAME} model card")
    return SamplingDefaults(source=f"none: no {GENERATION_CONFIG_FILE} beside the model")


def _is_embedded_model(model_path: str) -> bool:
    try:
        return os.path.realpath(model_path) == os.path.realpath(default_model_path())
    except ModelLoadError:     # not installed: then this file is not it
        return False


def _read_file(path: str) -> SamplingDefaults:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GenerationConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    if raw.get("do_sample") is False and any(raw.get(k) is not None for k in SAMPLING_FIELDS):
        logger.info("%s sets do_sample=false beside sampling values; like vLLM, those values are "
                    "still the defaults (HF generate() would decode greedily)", path)
    values = {k: raw[k] for k in SAMPLING_FIELDS if raw.get(k) is not None}
    try:
        return SamplingDefaults(**values, source=path)
    except ValueError as e:
        raise GenerationConfigError(f"{path}: {e}") from None

