"""Which model class serves which HF ``model_type``."""

from __future__ import annotations

from llmserve.common.basemodel import TpPartBaseModel
from llmserve.common.basemodel.layer_weights.hf_load_utils import ModelLoadError
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
