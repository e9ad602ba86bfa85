"""Tokenizer and end-of-sequence ids for a model path (HF directory or GGUF file)."""

from __future__ import annotations

import json
import os
from typing import Any

from llmserve.common.basemodel.layer_weights.gguf_load_utils import load_gguf_tokenizer
from llmserve.common.errors import ModelLoadError


def load_tokenizer(model_path: str) -> Any:
    if model_path.endswith(".gguf"):
        return load_gguf_tokenizer(model_path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {model_path}: {str(e).splitlines()[0]}") from e


def eos_token_ids(model_path: str, tokenizer: Any) -> set[int]:
    """Every id that ends a generation: the tokenizer's EOS plus the ids listed in the model's
    config.json and generation_config.json (Llama 3 Instruct ends turns with <|eot_id|>, which
    only generation_config names)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if os.path.isdir(model_path):
        for name in ("config.json", "generation_config.json"):
            path = os.path.join(model_path, name)
            if os.path.exists(path):
                with open(path) as f:
                    value = json.load(f).get("eos_token_id")
                ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    return ids
