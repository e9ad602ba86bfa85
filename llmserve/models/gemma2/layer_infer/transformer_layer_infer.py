from __future__ import annotations

import torch

from llmserve.common.distributed import PartialSum, add_rmsnorm
from llmserve.models.gemma.layer_infer.transformer_layer_infer import GemmaTransformerLayerInfer
from llmserve.models.llama.infer_struct import LlamaInferStateInfo


class Gemma2TransformerLayerInfer(GemmaTransformerLayerInfer):
    """Gemma's layer with the attention's and the MLP's outputs each normalised before they join
    the residual stream (in the launches that add them: see below), scores scaled by
    ``query_pre_attn_scalar ** -0.5`` and soft-capped (``attn_logit_softcapping``). The template gives a sliding window to the layers ``layer_types``
    marks ``sliding_attention`` (Gemma 2: every other one; Gemma 3: five of six)."""

    def __init__(self, layer_num: int, tp_rank: int, world_size: int, network_config):
        super().__init__(layer_num, tp_rank, world_size, network_config)
        cfg = network_config
        self.is_sliding_ = cfg.layer_types[layer_num] == "sliding_attention"
        self.sm_scale_ = cfg.query_pre_attn_scalar ** -0.5
        self.logit_softcap_ = getattr(cfg, "attn_logit_softcapping", None) or 0.0

    # Each output is normalised on its way into the residual stream, in the launch that adds it
    # and runs the next input norm: the attention's by the post-attention norm before the MLP's
    # input norm, the MLP's by the post-feedforward norm before the next layer's input norm (or
    # the final norm), so ``pending`` is this layer's MLP output before its post-feedforward norm,
    # and a layer's weights hold the previous layer's (``prev_post_ffn_norm_weight_``).

    def _add_att_norm(self, h: torch.Tensor, pending: torch.Tensor | PartialSum, infer_state: LlamaInferStateInfo,
                      layer_weight) -> torch.Tensor:
        return add_rmsnorm(h, pending, layer_weight.att_norm_weight_, self.eps_, round_first=False,
                           delta_weight=layer_weight.prev_post_ffn_norm_weight_)

    def _add_ffn_norm(self, h: torch.Tensor, attn_out: torch.Tensor | PartialSum, infer_state: LlamaInferStateInfo,
                      layer_weight) -> torch.Tensor:
        return add_rmsnorm(h, attn_out, layer_weight.ffn_norm_weight_, self.eps_, round_first=False,
                           delta_weight=layer_weight.post_att_norm_weight_)
