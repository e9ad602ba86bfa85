from __future__ import annotations

import torch

from llmserve.common.basemodel import PreAndPostLayerWeight, WeightSpec


class LlamaPreAndPostLayerWeight(PreAndPostLayerWeight):
    def weight_specs(self) -> dict[str, WeightSpec]:
        tied = bool(getattr(self.network_config_, "tie_word_embeddings", False))
        specs = {}
        if self.holds_pre_ or (self.holds_post_ and tied):
            specs["wte"] = WeightSpec("model.embed_tokens.weight", "vocab")
        if self.holds_post_:
            specs["lm_head"] = WeightSpec("lm_head.weight", "vocab", required=not tied)
            specs["final_norm"] = WeightSpec("model.norm.weight")
        return specs

    def _build(self, w: dict[str, torch.Tensor]) -> None:
        # None: another pipeline stage's
        self.wte_weight_ = w["wte"] if self.holds_pre_ else None
        self.lm_head_weight_ = w.get("lm_head", w.get("wte")) if self.holds_post_ else None
        self.final_norm_weight_ = w.get("final_norm")
