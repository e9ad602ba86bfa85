from __future__ import annotations

import torch

from llmserve.kernels import gelu_and_mul_fwd, linear
from llmserve.models.llama.infer_struct import LlamaInferStateInfo
from llmserve.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer


class GemmaTransformerLayerInfer(LlamaTransformerLayerInfer):
    """Llama's layer with GemmaRMSNorm's rounding (the weights are the fp32 1 + w) and the GeGLU
    MLP (tanh GELU)."""

    norm_round_first = False

    def _ffn(self, x: torch.Tensor, infer_state: LlamaInferStateInfo, layer_weight) -> torch.Tensor:
        act = gelu_and_mul_fwd(linear(x, layer_weight.gate_up_weight_))
        return self._row_parallel_linear(act, layer_weight.down_weight_, None)
