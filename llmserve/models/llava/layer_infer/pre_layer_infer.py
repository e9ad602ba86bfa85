from __future__ import annotations

import torch

from llmserve.common.basemodel import InferStateInfo
from llmserve.models.llama.layer_infer.pre_layer_infer import LlamaPreLayerInfer


class LlavaPreLayerInfer(LlamaPreLayerInfer):
    """The vocabulary lookup, then each image's features written over its placeholder tokens'
    rows (the placeholder id's own embedding is never used). After the vocab-parallel all-reduce
    every rank holds whole rows, and every rank has the whole features, so no collective more."""

    def context_forward(self, input_ids: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        h = super().context_forward(input_ids, infer_state, layer_weight)
        given = infer_state.input_embeds
        if given is not None:
            h.index_copy_(0, given.rows, given.embeds.to(h.dtype))
        return h
