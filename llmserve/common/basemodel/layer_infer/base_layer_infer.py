from __future__ import annotations

import torch

from llmserve.common.basemodel.infer_struct import InferStateInfo


class BaseLayerInfer:
    """Every forward enters through ``context_forward`` (any mix of cached and new tokens:
    prefill, chunked prefill, speculative verification) or ``token_forward`` (pure decode: one
    new token per request, where a split-K decode kernel is faster). Transformer and post layers
    take two inputs, the residual stream and the output still to be added to it, so their
    ``forward`` and the two entries take ``(h, pending, infer_state, layer_weight)``."""

    def forward(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        if infer_state.is_decode:
            return self.token_forward(x, infer_state, layer_weight)
        return self.context_forward(x, infer_state, layer_weight)

    def context_forward(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        raise NotImplementedError

    def token_forward(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        raise NotImplementedError
