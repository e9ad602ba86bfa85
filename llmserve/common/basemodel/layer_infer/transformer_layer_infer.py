from __future__ import annotations

from llmserve.common.basemodel.layer_infer.base_layer_infer import BaseLayerInfer


class TransformerLayerInfer(BaseLayerInfer):
    """One transformer layer; updates the hidden states and writes this layer's KV cache."""

    def __init__(self, layer_num: int, tp_rank: int, world_size: int, network_config):
        self.layer_num_ = layer_num
        self.tp_rank_ = tp_rank
        self.world_size_ = world_size
        self.network_config_ = network_config
