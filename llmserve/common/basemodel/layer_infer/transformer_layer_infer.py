from __future__ import annotations

import torch

from llmserve.common.basemodel.infer_struct import InferStateInfo
from llmserve.common.basemodel.layer_infer.base_layer_infer import BaseLayerInfer


class TransformerLayerInfer(BaseLayerInfer):
    """One transformer layer; updates the hidden states and writes this layer's KV cache.

    Layers hand the residual stream on as ``(h, pending)``: the stream is ``h + pending``, where
    ``pending`` is a sublayer's output not added yet (None: nothing is). The next layer's norm
    adds it in the same kernel (add_rmsnorm), which saves each layer a launch and a pass over the
    rows; ``h`` may be updated in place."""

    def __init__(self, layer_num: int, tp_rank: int, world_size: int, network_config):
        self.layer_num_ = layer_num
        # The layer's place in the KV cache (MemoryManager's lists): its number, unless the model
        # is a pipeline stage, whose cache holds its own layers only (set by the model).
        self.cache_layer_ = layer_num
        self.tp_rank_ = tp_rank
        self.world_size_ = world_size
        self.network_config_ = network_config

    def forward(self, h: torch.Tensor, pending: torch.Tensor | None, infer_state: InferStateInfo,  # type: ignore[override]
                layer_weight) -> tuple[torch.Tensor, torch.Tensor | None]:
        if infer_state.is_decode:
            return self.token_forward(h, pending, infer_state, layer_weight)
        return self.context_forward(h, pending, infer_state, layer_weight)
