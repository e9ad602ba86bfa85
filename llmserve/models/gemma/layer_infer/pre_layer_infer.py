from __future__ import annotations

import torch

from llmserve.common.basemodel import InferStateInfo, PreLayerInferTpl


class GemmaPreLayerInfer(PreLayerInferTpl):
    """The vocab-parallel embedding times sqrt(hidden_size), the factor rounded to the model's
    dtype first as HF does (``embed_scale.to(self.weight.dtype)``; bf16 makes 48.0 of sqrt(2304))."""

    def _norm(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        scale = torch.tensor(self.network_config_.hidden_size ** 0.5, dtype=x.dtype).item()  # host only
        return x.mul_(scale)
