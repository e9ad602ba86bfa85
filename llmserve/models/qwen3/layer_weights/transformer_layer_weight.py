from __future__ import annotations

from llmserve.common.basemodel import WeightSpec
from llmserve.common.basemodel.layer_weights.base_layer_weight import Weight
from llmserve.models.llama.layer_weights.transformer_layer_weight import LlamaTransformerLayerWeight


class Qwen3TransformerLayerWeight(LlamaTransformerLayerWeight):
    """Llama's layer plus ``q_norm`` and ``k_norm``: RMSNorm weights of one head's size
    (``[head_dim]``), shared by every head, so every tensor-parallel rank holds them whole."""

    def weight_specs(self) -> dict[str, WeightSpec]:
        p = f"model.layers.{self.layer_num_}.self_attn."
        return {
            **super().weight_specs(),
            "q_norm": WeightSpec(p + "q_norm.weight"),
            "k_norm": WeightSpec(p + "k_norm.weight"),
        }

    def _build(self, w: dict[str, Weight]) -> None:
        super()._build(w)
        self.q_norm_weight_ = w["q_norm"]
        self.k_norm_weight_ = w["k_norm"]
