from __future__ import annotations

from llmserve.common.basemodel.layer_infer.base_layer_infer import BaseLayerInfer


class PreLayerInfer(BaseLayerInfer):
    """Token ids -> the first hidden states."""

    def __init__(self, tp_rank: int, world_size: int, network_config):
        self.tp_rank_ = tp_rank
        self.world_size_ = world_size
        self.network_config_ = network_config
