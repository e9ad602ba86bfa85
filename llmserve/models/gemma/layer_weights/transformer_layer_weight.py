from __future__ import annotations

import torch

from llmserve.common.basemodel.layer_weights.base_layer_weight import Weight
from llmserve.models.llama.layer_weights.transformer_layer_weight import LlamaTransformerLayerWeight


def gemma_norm_weight(w: torch.Tensor) -> torch.Tensor:
    """GemmaRMSNorm multiplies by ``1 + w`` in fp32 (HF: ``output * (1.0 + self.weight.float())``):
    stored so, the norm kernels run with ``round_first=False``."""
    return 1.0 + w.float()


class GemmaTransformerLayerWeight(LlamaTransformerLayerWeight):
    """Gemma's layer: Llama's tensors and names (``post_attention_layernorm`` is the MLP's input
    norm, as in Llama), the norms stored as ``gemma_norm_weight``."""

    def _build(self, w: dict[str, Weight]) -> None:
        super()._build(w)
        self.att_norm_weight_ = gemma_norm_weight(self.att_norm_weight_)
        self.ffn_norm_weight_ = gemma_norm_weight(self.ffn_norm_weight_)
