from __future__ import annotations

import torch

from llmserve.kernels import gelu_and_mul_fwd
from llmserve.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer


class GemmaTransformerLayerInfer(LlamaTransformerLayerInfer):
    """Llama's layer with GemmaRMSNorm's rounding (the weights are the fp32 1 + w) and the GeGLU
    MLP (tanh GELU)."""

    norm_round_first = False

    def _act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul_fwd(gate_up)
