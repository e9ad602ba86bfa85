"""The model framework: `TpPartBaseModel`, the layer-infer templates and the weight classes.

The names below are loaded on first use (PEP 562), not when the package is imported: the HTTP
process imports `layer_weights.gguf_load_utils` for the GGUF tokenizer, and importing this
package eagerly would drag torch, Triton and every kernel into it (2.5 s of its start-up).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOME = {
    "ModelInitParams": "basemodel", "TpPartBaseModel": "basemodel",
    "InferStateInfo": "infer_struct", "InputEmbeds": "infer_struct",
    "PreLayerInfer": "layer_infer.pre_layer_infer",
    "TransformerLayerInfer": "layer_infer.transformer_layer_infer",
    "PostLayerInfer": "layer_infer.post_layer_infer",
    "PreLayerInferTpl": "layer_infer.template", "TransformerLayerInferTpl": "layer_infer.template",
    "PostLayerInferTpl": "layer_infer.template",
    "WeightSpec": "layer_weights.base_layer_weight",
    "PreAndPostLayerWeight": "layer_weights.pre_and_post_layer_weight",
    "TransformerLayerWeight": "layer_weights.transformer_layer_weight",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


if TYPE_CHECKING:
    from llmserve.common.basemodel.basemodel import ModelInitParams, TpPartBaseModel
    from llmserve.common.basemodel.infer_struct import InferStateInfo, InputEmbeds
    from llmserve.common.basemodel.layer_infer.post_layer_infer import PostLayerInfer
    from llmserve.common.basemodel.layer_infer.pre_layer_infer import PreLayerInfer
    from llmserve.common.basemodel.layer_infer.template import PostLayerInferTpl, PreLayerInferTpl, TransformerLayerInferTpl
    from llmserve.common.basemodel.layer_infer.transformer_layer_infer import TransformerLayerInfer
    from llmserve.common.basemodel.layer_weights.base_layer_weight import WeightSpec
    from llmserve.common.basemodel.layer_weights.pre_and_post_layer_weight import PreAndPostLayerWeight
    from llmserve.common.basemodel.layer_weights.transformer_layer_weight import TransformerLayerWeight
