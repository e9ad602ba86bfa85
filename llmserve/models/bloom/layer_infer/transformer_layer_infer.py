from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.common.basemodel import InferStateInfo, TransformerLayerInferTpl
from llmserve.kernels import layernorm_forward


class BloomTransformerLayerInfer(TransformerLayerInferTpl):
    """LayerNorm, ALiBi attention, GELU MLP with biases."""

    def __init__(self, layer_num: int, tp_rank: int, world_size: int, network_config):
        super().__init__(layer_num, tp_rank, world_size, network_config)
        self.eps_ = network_config.layer_norm_epsilon

    def _att_norm(self, h: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return layernorm_forward(h, layer_weight.att_norm_weight_, layer_weight.att_norm_bias_, self.eps_)

    def _ffn_norm(self, h: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return layernorm_forward(h, layer_weight.ffn_norm_weight_, layer_weight.ffn_norm_bias_, self.eps_)

    def _alibi_slopes(self, layer_weight) -> torch.Tensor:
        return layer_weight.tp_alibi

    def _ffn(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        act = F.gelu(F.linear(x, layer_weight.ffn_1_weight_, layer_weight.ffn_1_bias_), approximate="tanh")
        return self._row_parallel_linear(act, layer_weight.ffn_2_weight_, layer_weight.ffn_2_bias_)
