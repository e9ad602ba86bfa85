from __future__ import annotations

import torch

from llmserve.common.basemodel import InferStateInfo, TpPartBaseModel
from llmserve.models.bloom.layer_infer.post_layer_infer import BloomPostLayerInfer
from llmserve.models.bloom.layer_infer.pre_layer_infer import BloomPreLayerInfer
from llmserve.models.bloom.layer_infer.transformer_layer_infer import BloomTransformerLayerInfer
from llmserve.models.bloom.layer_weights.pre_and_post_layer_weight import BloomPreAndPostLayerWeight
from llmserve.models.bloom.layer_weights.transformer_layer_weight import BloomTransformerLayerWeight


class BloomTpPartModel(TpPartBaseModel):
    pre_and_post_weight_class = BloomPreAndPostLayerWeight
    transformer_weight_class = BloomTransformerLayerWeight

    pre_layer_infer_class = BloomPreLayerInfer
    post_layer_infer_class = BloomPostLayerInfer
    transformer_layer_infer_class = BloomTransformerLayerInfer

    infer_state_class = InferStateInfo

    def _rename_hf_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # transformers saves BloomForCausalLM under "transformer."; the original BigScience
        # checkpoints have bare names. Accept both.
        return {k.removeprefix("transformer."): v for k, v in weights.items()}
