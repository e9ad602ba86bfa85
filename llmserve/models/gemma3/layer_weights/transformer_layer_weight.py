from __future__ import annotations

from llmserve.common.basemodel.layer_weights.base_layer_weight import Weight
from llmserve.models.gemma.layer_weights.transformer_layer_weight import gemma_norm_weight
from llmserve.models.gemma2.layer_weights.transformer_layer_weight import Gemma2TransformerLayerWeight
from llmserve.models.qwen3.layer_weights.transformer_layer_weight import Qwen3TransformerLayerWeight


class Gemma3TransformerLayerWeight(Qwen3TransformerLayerWeight, Gemma2TransformerLayerWeight):
    """Gemma 2's layer plus Qwen3's ``q_norm`` and ``k_norm`` (one head's size, whole on every
    rank), stored as ``gemma_norm_weight``. (MRO: Qwen3's specs and build on top of Gemma 2's.)"""

    def _build(self, w: dict[str, Weight]) -> None:
        super()._build(w)
        self.q_norm_weight_ = gemma_norm_weight(self.q_norm_weight_)
        self.k_norm_weight_ = gemma_norm_weight(self.k_norm_weight_)
