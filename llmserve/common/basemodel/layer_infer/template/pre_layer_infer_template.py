from __future__ import annotations

import torch

from llmserve.common.basemodel.infer_struct import InferStateInfo
from llmserve.common.basemodel.layer_infer.pre_layer_infer import PreLayerInfer
from llmserve.common.basemodel.layer_weights.base_layer_weight import vocab_shard_size
from llmserve.common.distributed import all_reduce
from llmserve.kernels import embedding


class PreLayerInferTpl(PreLayerInfer):
    """Vocab-parallel embedding: each rank holds a slice of the vocabulary, looks up the ids that
    fall in it, zeroes the others, and an all-reduce assembles the full rows."""

    def __init__(self, tp_rank: int, world_size: int, network_config):
        super().__init__(tp_rank, world_size, network_config)
        shard = vocab_shard_size(network_config.vocab_size, world_size)
        self.vob_start_id_ = shard * tp_rank
        self.vob_end_id_ = shard * (tp_rank + 1)

    def _norm(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return x

    def context_forward(self, input_ids: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return self._norm(self._embed(input_ids, layer_weight), infer_state, layer_weight)

    def token_forward(self, input_ids: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return self.context_forward(input_ids, infer_state, layer_weight)

    def _embed(self, input_ids: torch.Tensor, layer_weight) -> torch.Tensor:
        if self.world_size_ == 1:
            return embedding(input_ids, layer_weight.wte_weight_)
        outside = (input_ids < self.vob_start_id_) | (input_ids >= self.vob_end_id_)
        local_ids = (input_ids - self.vob_start_id_).masked_fill(outside, 0)
        emb = embedding(local_ids, layer_weight.wte_weight_)
        emb.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(emb)
