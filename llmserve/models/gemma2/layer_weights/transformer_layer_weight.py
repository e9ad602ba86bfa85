from __future__ import annotations

from llmserve.common.basemodel import WeightSpec
from llmserve.common.basemodel.layer_weights.base_layer_weight import Weight
from llmserve.models.gemma.layer_weights.transformer_layer_weight import GemmaTransformerLayerWeight, gemma_norm_weight


class Gemma2TransformerLayerWeight(GemmaTransformerLayerWeight):
    """Gemma's layer with four norms: the MLP's input norm is ``pre_feedforward_layernorm``, and
    ``post_attention_layernorm`` / ``post_feedforward_layernorm`` normalise the attention's and
    the MLP's outputs before they join the residual stream. ``prev_post_ffn_norm_weight_`` is the
    previous layer's post-feedforward norm (None in the first layer), which this layer's first
    launch applies (Gemma2TpPartModel links them once all are loaded)."""

    def weight_specs(self) -> dict[str, WeightSpec]:
        p = f"model.layers.{self.layer_num_}."
        return {
            **super().weight_specs(),
            "ffn_norm": WeightSpec(p + "pre_feedforward_layernorm.weight"),
            "post_att_norm": WeightSpec(p + "post_attention_layernorm.weight"),
            "post_ffn_norm": WeightSpec(p + "post_feedforward_layernorm.weight"),
        }

    def _build(self, w: dict[str, Weight]) -> None:
        super()._build(w)
        self.post_att_norm_weight_ = gemma_norm_weight(w["post_att_norm"])
        self.post_ffn_norm_weight_ = gemma_norm_weight(w["post_ffn_norm"])
        self.prev_post_ffn_norm_weight_ = None
