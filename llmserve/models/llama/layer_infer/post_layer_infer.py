from __future__ import annotations

import torch

from llmserve.common.basemodel import InferStateInfo, PostLayerInferTpl
from llmserve.kernels import rmsnorm_forward


class LlamaPostLayerInfer(PostLayerInferTpl):
    def _norm(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return rmsnorm_forward(x, layer_weight.final_norm_weight_, self.network_config_.rms_norm_eps)
