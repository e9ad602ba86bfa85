from __future__ import annotations

import torch

from llmserve.common.basemodel import InferStateInfo, PostLayerInferTpl
from llmserve.kernels import add_rmsnorm_forward, rmsnorm_forward


class LlamaPostLayerInfer(PostLayerInferTpl):
    norm_round_first: bool = True   # as LlamaTransformerLayerInfer's

    def _norm(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return rmsnorm_forward(x, layer_weight.final_norm_weight_, self.network_config_.rms_norm_eps,
                               self.norm_round_first)

    def _add_norm(self, h: torch.Tensor, pending: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return add_rmsnorm_forward(h, pending, layer_weight.final_norm_weight_, self.network_config_.rms_norm_eps,
                                   self.norm_round_first)
