from __future__ import annotations

from llmserve.common.basemodel.layer_infer.base_layer_infer import BaseLayerInfer


class PostLayerInfer(BaseLayerInfer):
    """Last hidden states -> float32 logits over the whole vocabulary."""

    def __init__(self, tp_rank: int, world_size: int, network_config):
        self.tp_rank_ = tp_rank
        self.world_size_ = world_size
        self.network_config_ = network_config
