from __future__ import annotations

import torch

from llmserve.common.basemodel import PreAndPostLayerWeight, WeightSpec


class LlamaPreAndPostLayerWeight(PreAndPostLayerWeight):
    def weight_specs(self) -> dict[str, WeightSpec]:
        tied = bool(getattr(self.network_config_, "tie_word_embeddings", False))
        return {
            "wte": WeightSpec("model.embed_tokens.weight", "vocab"),
            "lm_head": WeightSpec("lm_head.weight", "vocab", required=not tied),
            "final_norm": WeightSpec("model.norm.weight"),
        }

    def _build(self, w: dict[str, torch.Tensor]) -> None:
        self.wte_weight_ = w["wte"]
        self.lm_head_weight_ = w.get("lm_head", w["wte"])
        self.final_norm_weight_ = w["final_norm"]
