from __future__ import annotations

import torch

from llmserve.common.basemodel import PreAndPostLayerWeight, WeightSpec


class BloomPreAndPostLayerWeight(PreAndPostLayerWeight):
    """BLOOM normalises the embeddings too, and always ties lm_head to them."""

    def weight_specs(self) -> dict[str, WeightSpec]:
        return {
            "wte": WeightSpec("word_embeddings.weight", "vocab"),
            "pre_norm": WeightSpec("word_embeddings_layernorm.weight"),
            "pre_norm_bias": WeightSpec("word_embeddings_layernorm.bias"),
            "final_norm": WeightSpec("ln_f.weight"),
            "final_norm_bias": WeightSpec("ln_f.bias"),
        }

    def _build(self, w: dict[str, torch.Tensor]) -> None:
        self.wte_weight_ = self.lm_head_weight_ = w["wte"]
        self.pre_norm_weight_, self.pre_norm_bias_ = w["pre_norm"], w["pre_norm_bias"]
        self.final_norm_weight_, self.final_norm_bias_ = w["final_norm"], w["final_norm_bias"]
