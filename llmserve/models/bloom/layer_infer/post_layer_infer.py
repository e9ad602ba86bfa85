from __future__ import annotations

import torch

from llmserve.common.basemodel import InferStateInfo, PostLayerInferTpl
from llmserve.kernels import layernorm_forward


class BloomPostLayerInfer(PostLayerInferTpl):
    def _norm(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return layernorm_forward(x, layer_weight.final_norm_weight_, layer_weight.final_norm_bias_, self.network_config_.layer_norm_epsilon)
