from __future__ import annotations

import torch

from llmserve.kernels import rmsnorm_forward
from llmserve.models.gemma.model import GemmaTpPartModel
from llmserve.models.gemma2.layer_infer.post_layer_infer import Gemma2PostLayerInfer
from llmserve.models.gemma2.layer_infer.transformer_layer_infer import Gemma2TransformerLayerInfer
from llmserve.models.gemma2.layer_weights.transformer_layer_weight import Gemma2TransformerLayerWeight


class Gemma2TpPartModel(GemmaTpPartModel):
    """Gemma 2: Gemma's layer with post-attention and post-MLP norms, attention-score and
    final-logit soft-capping, ``query_pre_attn_scalar`` and sliding windows on alternate layers.

    The KV cache keeps every token of a request, also those that left a sliding layer's window:
    half the layers are global and read all of them, so freeing the others would save at most
    half a request's slots, only past the window (4096 tokens), and would need per-layer slot
    tables. Families whose every layer slides (Mistral) are where freeing would pay."""

    transformer_weight_class = Gemma2TransformerLayerWeight
    transformer_layer_infer_class = Gemma2TransformerLayerInfer
    post_layer_infer_class = Gemma2PostLayerInfer

    def _init_weights(self) -> None:
        super()._init_weights()
        # A layer's post-feedforward norm runs in the next one's first launch (or the post
        # layer's): each is handed the one before it.
        prev = None
        for layer_weight in self.trans_layers_weight:
            layer_weight.prev_post_ffn_norm_weight_ = prev
            prev = layer_weight.post_ffn_norm_weight_
        self.pre_post_weight.last_post_ffn_norm_weight_ = prev

    def _stage_output(self, h: torch.Tensor, pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The next stage's first layer holds no previous layer's post-feedforward norm (its
        # prev_post_ffn_norm_weight_ is None): it adds pending as it comes, so it comes normalised.
        return h, rmsnorm_forward(pending, self.pre_post_weight.last_post_ffn_norm_weight_,
                                  self.network_config_.rms_norm_eps, round_first=False)
