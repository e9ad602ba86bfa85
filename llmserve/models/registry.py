"""Which model class serves which HF ``model_type``."""

from __future__ import annotations

from llmserve.common.basemodel import TpPartBaseModel
from llmserve.common.basemodel.layer_weights.gguf_load_utils import gguf_config
from llmserve.common.basemodel.layer_weights.hf_load_utils import ModelLoadError, load_hf_config
from llmserve.models.bloom.model import BloomTpPartModel
from llmserve.models.llama.model import LlamaTpPartModel

MODEL_CLASSES: dict[str, type[TpPartBaseModel]] = {
    "llama": LlamaTpPartModel,
    "mistral": LlamaTpPartModel,
    "qwen2": LlamaTpPartModel,
    "bloom": BloomTpPartModel,
}


def get_model_class(model_type: str | None) -> type[TpPartBaseModel]:
    try:
        return MODEL_CLASSES[model_type]
    except KeyError:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(MODEL_CLASSES))}"
        ) from None


def peek_model_config(model_path: str) -> dict:
    """The checkpoint's HF-style config, read cheaply (no weights) before choosing the model class."""
    if model_path.endswith(".gguf"):
        return gguf_config(model_path)
    return load_hf_config(model_path)
