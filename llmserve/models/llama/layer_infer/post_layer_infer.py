from __future__ import annotations

import torch

from llmserve.common.basemodel import InferStateInfo, PostLayerInferTpl
from llmserve.common.distributed import PartialSum, add_rmsnorm
from llmserve.kernels import rmsnorm_forward


class LlamaPostLayerInfer(PostLayerInferTpl):
    norm_round_first: bool = True   # as LlamaTransformerLayerInfer's

    def _norm(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return rmsnorm_forward(x, layer_weight.final_norm_weight_, self.network_config_.rms_norm_eps,
                               self.norm_round_first)

    def _add_norm(self, h: torch.Tensor, pending: torch.Tensor | PartialSum, infer_state: InferStateInfo,
                  layer_weight) -> torch.Tensor:
        return add_rmsnorm(h, pending, layer_weight.final_norm_weight_, self.network_config_.rms_norm_eps,
                           self.norm_round_first)
