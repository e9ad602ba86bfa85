from __future__ import annotations

import torch

from llmserve.common.basemodel.infer_struct import InferStateInfo
from llmserve.common.basemodel.layer_infer.post_layer_infer import PostLayerInfer
from llmserve.common.distributed import all_gather_last_dim
from llmserve.kernels import linear


class PostLayerInferTpl(PostLayerInfer):
    """Final norm and vocab-parallel lm_head. Only the last new token of each request needs
    logits unless the caller asks for all of them (speculative verification, prompt logprobs).
    A config's ``final_logit_softcapping`` (Gemma 2) caps the logits: c * tanh(logits / c)."""

    def __init__(self, tp_rank: int, world_size: int, network_config):
        super().__init__(tp_rank, world_size, network_config)
        self.final_logit_softcap_: float = getattr(network_config, "final_logit_softcapping", None) or 0.0

    def _norm(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        raise NotImplementedError

    def _add_norm(self, h: torch.Tensor, pending: torch.Tensor, infer_state: InferStateInfo,
                  layer_weight) -> torch.Tensor:
        """``h += pending`` in place (the last layer's output), then the final norm of ``h``."""
        h.add_(pending)
        return self._norm(h, infer_state, layer_weight)

    def context_forward(self, h: torch.Tensor, pending: torch.Tensor | None, infer_state: InferStateInfo,
                        layer_weight) -> torch.Tensor:
        if infer_state.logit_rows is not None:  # the add is per row: adding the chosen rows only is the same
            h = h[infer_state.logit_rows]
            pending = None if pending is None else pending[infer_state.logit_rows]
        return self._logits(h, pending, infer_state, layer_weight)

    def token_forward(self, h: torch.Tensor, pending: torch.Tensor | None, infer_state: InferStateInfo,
                      layer_weight) -> torch.Tensor:
        return self._logits(h, pending, infer_state, layer_weight)  # already one row per request

    def _logits(self, h: torch.Tensor, pending: torch.Tensor | None, infer_state: InferStateInfo,
                layer_weight) -> torch.Tensor:
        if pending is None:  # a model without layers
            x = self._norm(h, infer_state, layer_weight)
        else:
            x = self._add_norm(h, pending, infer_state, layer_weight)
        logits = all_gather_last_dim(linear(x, layer_weight.lm_head_weight_))
        logits = logits[:, : self.network_config_.vocab_size].float()
        if self.final_logit_softcap_:   # in fp32 (HF caps in the model's dtype: the same in fp32)
            logits = torch.tanh(logits.div_(self.final_logit_softcap_)).mul_(self.final_logit_softcap_)
        return logits
