from __future__ import annotations

import torch

from llmserve.common.basemodel.infer_struct import InferStateInfo
from llmserve.common.basemodel.layer_infer.base_layer_infer import BaseLayerInfer


class PostLayerInfer(BaseLayerInfer):
    """Last hidden states -> float32 logits over the whole vocabulary. The hidden states come as
    the layers hand them on: ``h + pending`` (see TransformerLayerInfer)."""

    def __init__(self, tp_rank: int, world_size: int, network_config):
        self.tp_rank_ = tp_rank
        self.world_size_ = world_size
        self.network_config_ = network_config

    def forward(self, h: torch.Tensor, pending: torch.Tensor | None, infer_state: InferStateInfo,  # type: ignore[override]
                layer_weight) -> torch.Tensor:
        if infer_state.is_decode:
            return self.token_forward(h, pending, infer_state, layer_weight)
        return self.context_forward(h, pending, infer_state, layer_weight)
