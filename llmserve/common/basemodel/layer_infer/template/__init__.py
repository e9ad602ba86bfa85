from llmserve.common.basemodel.layer_infer.template.post_layer_infer_template import PostLayerInferTpl
from llmserve.common.basemodel.layer_infer.template.pre_layer_infer_template import PreLayerInferTpl
from llmserve.common.basemodel.layer_infer.template.transformer_layer_infer_template import TransformerLayerInferTpl

__all__ = ["PreLayerInferTpl", "PostLayerInferTpl", "TransformerLayerInferTpl"]
