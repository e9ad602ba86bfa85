from __future__ import annotations

from llmserve.common.basemodel import WeightSpec
from llmserve.common.basemodel.layer_weights.base_layer_weight import Weight
from llmserve.models.gemma.layer_weights.transformer_layer_weight import gemma_norm_weight
from llmserve.models.gemma2.layer_weights.transformer_layer_weight import Gemma2TransformerLayerWeight


class Gemma3TransformerLayerWeight(Gemma2TransformerLayerWeight):
    """Gemma 2's layer plus ``q_norm`` and ``k_norm`` (one head's size, whole on every rank, as
    Qwen3's), stored as ``gemma_norm_weight``."""

    def weight_specs(self) -> dict[str, WeightSpec]:
        p = f"model.layers.{self.layer_num_}.self_attn."
        return {
            **super().weight_specs(),
            "q_norm": WeightSpec(p + "q_norm.weight"),
            "k_norm": WeightSpec(p + "k_norm.weight"),
        }

    def _build(self, w: dict[str, Weight]) -> None:
        super()._build(w)
        self.q_norm_weight_ = gemma_norm_weight(w["q_norm"])
        self.k_norm_weight_ = gemma_norm_weight(w["k_norm"])
