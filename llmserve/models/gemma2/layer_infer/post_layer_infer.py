from __future__ import annotations

import torch

from llmserve.common.basemodel import InferStateInfo
from llmserve.common.distributed import PartialSum, add_rmsnorm
from llmserve.models.gemma.layer_infer.post_layer_infer import GemmaPostLayerInfer


class Gemma2PostLayerInfer(GemmaPostLayerInfer):
    """Gemma's, with the last layer's MLP output normalised by that layer's post-feedforward norm
    on its way into the residual stream (see Gemma2TransformerLayerInfer), in the same launch as
    the add and the final norm."""

    def _add_norm(self, h: torch.Tensor, pending: torch.Tensor | PartialSum, infer_state: InferStateInfo,
                  layer_weight) -> torch.Tensor:
        return add_rmsnorm(h, pending, layer_weight.final_norm_weight_, self.network_config_.rms_norm_eps,
                           self.norm_round_first, delta_weight=layer_weight.last_post_ffn_norm_weight_)
