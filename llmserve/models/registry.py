"""Which model class serves which HF ``model_type``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from llmserve.common.basemodel.layer_weights.gguf_load_utils import GGUFArch, gguf_config
from llmserve.common.basemodel.model_shape import verify_pp_split
from llmserve.common.basemodel.layer_weights.hf_load_utils import ModelLoadError, load_hf_config
from llmserve.models.gemma import gguf as gemma_gguf
from llmserve.models.llama import gguf as llama_gguf
from llmserve.models.phi3 import gguf as phi3_gguf
from llmserve.models.qwen3 import gguf as qwen3_gguf
from llmserve.models.qwen_moe import gguf as qwen_moe_gguf

if TYPE_CHECKING:
    from llmserve.common.basemodel import TpPartBaseModel

# model_type -> "module:class", imported on first use: the HTTP process checks a model_type here
# (check_model_type) without importing torch, which the model code needs.
MODEL_CLASSES: dict[str, str] = {
    "llama": "llmserve.models.llama.model:LlamaTpPartModel",
    "mistral": "llmserve.models.llama.model:LlamaTpPartModel",
    "qwen2": "llmserve.models.llama.model:LlamaTpPartModel",
    "qwen3": "llmserve.models.qwen3.model:Qwen3TpPartModel",
    "phi3": "llmserve.models.phi3.model:Phi3TpPartModel",
    "gemma": "llmserve.models.gemma.model:GemmaTpPartModel",
    "gemma2": "llmserve.models.gemma2.model:Gemma2TpPartModel",
    "gemma3_text": "llmserve.models.gemma3.model:Gemma3TpPartModel",
    "gemma3": "llmserve.models.gemma3.conditional:Gemma3ConditionalTpPartModel",   # its text decoder
    "mixtral": "llmserve.models.mixtral.model:MixtralTpPartModel",
    "qwen2_moe": "llmserve.models.qwen_moe.model:Qwen2MoeTpPartModel",
    "qwen3_moe": "llmserve.models.qwen_moe.model:Qwen3MoeTpPartModel",
    "bloom": "llmserve.models.bloom.model:BloomTpPartModel",
    "llava": "llmserve.models.llava.model:LlavaTpPartModel",
}

# The families whose stages can split (``--pp`` > 1): each stage builds only its layers, stage 0
# the embedding and the last the final norm and lm_head (PreAndPostLayerWeight). Not BLOOM (its
# embedding's LayerNorm and ALiBi are not split yet) nor the models that take images (the vision
# tower feeds stage 0's embedding: not wired through the stages yet).
PIPELINE_MODEL_TYPES = frozenset(MODEL_CLASSES) - {"bloom", "llava", "gemma3"}

# GGUF general.architecture -> how its files map onto HF names: each family's table, from its
# folder (the model class reads its own family's the same way: TpPartBaseModel.gguf_archs).
GGUF_ARCHS: dict[str, GGUFArch] = {**llama_gguf.GGUF_ARCHS, **qwen3_gguf.GGUF_ARCHS, **phi3_gguf.GGUF_ARCHS,
                                   **gemma_gguf.GGUF_ARCHS, **qwen_moe_gguf.GGUF_ARCHS}


def check_model_type(model_type: str | None) -> None:
    """``ModelLoadError`` unless a model class serves ``model_type``."""
    if model_type not in MODEL_CLASSES:
        raise ModelLoadError(f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(MODEL_CLASSES))}")


def check_pipeline_split(model_type: str, num_layers: int | None, pp: int) -> None:
    """``ValueError`` unless ``pp`` pipeline stages can split the model (of ``num_layers``;
    None: not known yet, the worker checks again)."""
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if pp > 1 and model_type not in PIPELINE_MODEL_TYPES:
        raise ValueError(f"pipeline parallelism (pp > 1) is not supported for {model_type} models yet; "
                         f"supported: {', '.join(sorted(PIPELINE_MODEL_TYPES))}")
    if num_layers is not None:
        verify_pp_split(num_layers, pp)


def get_model_class(model_type: str | None) -> type[TpPartBaseModel]:
    check_model_type(model_type)
    module, name = MODEL_CLASSES[model_type].split(":")
    return getattr(importlib.import_module(module), name)


def peek_model_config(model_path: str) -> dict:
    """The checkpoint's HF-style config, read cheaply (no weights, no torch) before choosing the
    model class."""
    if model_path.endswith(".gguf"):
        return gguf_config(model_path, GGUF_ARCHS)
    return load_hf_config(model_path)
