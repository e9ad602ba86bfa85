from __future__ import annotations

import torch

from llmserve.models.gemma.layer_weights.transformer_layer_weight import gemma_norm_weight
from llmserve.models.llama.layer_weights.pre_and_post_layer_weight import LlamaPreAndPostLayerWeight


class GemmaPreAndPostLayerWeight(LlamaPreAndPostLayerWeight):
    """Llama's (the embedding is the LM head too: Gemmas tie them), the final norm stored as the
    fp32 ``1 + w`` that GemmaRMSNorm multiplies by."""

    def _build(self, w: dict[str, torch.Tensor]) -> None:
        super()._build(w)
        if self.holds_post_:
            self.final_norm_weight_ = gemma_norm_weight(w["final_norm"])
