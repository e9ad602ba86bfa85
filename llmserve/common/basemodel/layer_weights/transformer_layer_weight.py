from __future__ import annotations

import torch

from llmserve.common.basemodel.layer_weights.base_layer_weight import BaseLayerWeight


class TransformerLayerWeight(BaseLayerWeight):
    """Weights of transformer layer ``layer_num``, split column / row-wise for this rank."""

    quantizes_on_load = True

    def __init__(self, layer_num: int, tp_rank: int, world_size: int, data_type: torch.dtype, network_config, device: torch.device):
        super().__init__(tp_rank, world_size, data_type, network_config, device)
        self.layer_num_ = layer_num
