from __future__ import annotations

from llmserve.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer


class GemmaTransformerLayerInfer(LlamaTransformerLayerInfer):
    """Llama's layer with GemmaRMSNorm's rounding (the weights are the fp32 1 + w) and the GeGLU
    MLP (tanh GELU)."""

    norm_round_first = False
    mlp_act = "gelu_tanh"
