from llmserve.common.basemodel.basemodel import ModelInitParams, TpPartBaseModel
from llmserve.common.basemodel.infer_struct import InferStateInfo
from llmserve.common.basemodel.layer_infer.post_layer_infer import PostLayerInfer
from llmserve.common.basemodel.layer_infer.pre_layer_infer import PreLayerInfer
from llmserve.common.basemodel.layer_infer.template import PostLayerInferTpl, PreLayerInferTpl, TransformerLayerInferTpl
from llmserve.common.basemodel.layer_infer.transformer_layer_infer import TransformerLayerInfer
from llmserve.common.basemodel.layer_weights.base_layer_weight import WeightSpec
from llmserve.common.basemodel.layer_weights.pre_and_post_layer_weight import PreAndPostLayerWeight
from llmserve.common.basemodel.layer_weights.transformer_layer_weight import TransformerLayerWeight

__all__ = [
    "InferStateInfo", "ModelInitParams", "TpPartBaseModel",
    "PreLayerInfer", "TransformerLayerInfer", "PostLayerInfer",
    "PreLayerInferTpl", "TransformerLayerInferTpl", "PostLayerInferTpl",
    "PreAndPostLayerWeight", "TransformerLayerWeight", "WeightSpec",
]
