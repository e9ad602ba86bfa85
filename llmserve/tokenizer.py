"""Tokenizer and end-of-sequence ids for a model path (HF directory or GGUF file)."""

from __future__ import annotations

import json
import os
from typing import Any

from llmserve.common.basemodel.layer_weights.gguf_load_utils import load_gguf_tokenizer
from llmserve.common.errors import ModelLoadError

# tokenizer_config.json's names for a tokenizer that is its tokenizer.json as the `tokenizers`
# library reads it (what transformers 5 saves for a converted or generic vocabulary).
TOKENIZERS_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")

# The model types for which AutoTokenizer loads such a tokenizer as TokenizersBackend: for some
# others it swaps in a class of its own (qwen2: Qwen2Tokenizer), so those still go through it.
# tests/test_tokenizer.py holds every one against AutoTokenizer.
BACKEND_KEPT_FOR = frozenset({"llama", "mistral", "mixtral", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "gemma",
                              "gemma2", "gemma3", "gemma3_text", "bloom", "llava"})


def load_tokenizer(model_path: str) -> Any:
    """The model's tokenizer, as ``AutoTokenizer.from_pretrained`` loads it.

    Where that is a TokenizersBackend it is loaded as one directly: AutoTokenizer reads the
    model's config through transformers' config classes, which import torch (5 CPU-s and 200 MB
    in the HTTP process, which otherwise has no use for it)."""
    if model_path.endswith(".gguf"):
        return load_gguf_tokenizer(model_path)
    try:
        if _auto_tokenizer_is_backend(model_path):
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(model_path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {model_path}: {str(e).splitlines()[0]}") from e


def _auto_tokenizer_is_backend(model_dir: str) -> bool:
    """Whether AutoTokenizer would load this directory's tokenizer as a plain TokenizersBackend:
    it declares one (and no code of its own) for a model type AutoTokenizer keeps it for."""
    tokenizer_config, config = _read_json(model_dir, "tokenizer_config.json"), _read_json(model_dir, "config.json")
    return (tokenizer_config.get("tokenizer_class") in TOKENIZERS_BACKEND_CLASSES
            and "auto_map" not in tokenizer_config and "auto_map" not in config
            and config.get("model_type") in BACKEND_KEPT_FOR)


def _read_json(model_dir: str, name: str) -> dict:
    """A JSON file of the model directory; {} where there is none or it is not an object (AutoTokenizer
    then reports what is wrong)."""
    try:
        with open(os.path.join(model_dir, name)) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


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
