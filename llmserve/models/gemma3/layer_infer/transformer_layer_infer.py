from __future__ import annotations

import torch

from llmserve.models.gemma2.layer_infer.transformer_layer_infer import Gemma2TransformerLayerInfer
from llmserve.models.gemma3.infer_struct import Gemma3InferStateInfo
from llmserve.models.qwen3.layer_infer.transformer_layer_infer import Qwen3TransformerLayerInfer


class Gemma3TransformerLayerInfer(Qwen3TransformerLayerInfer, Gemma2TransformerLayerInfer):
    """Gemma 2's layer with Qwen3's per-head q and k norms before rotary (Gemma's norm rounding,
    through ``norm_round_first``), the sliding layers rotating with their own tables. The window
    pattern comes from the config; attention scores are never soft-capped: HF's Gemma3Attention
    keeps the config's ``attn_logit_softcapping`` but does not apply it (the final-logit cap it
    applies). (MRO: Qwen3's ``_qk_norm`` on top of Gemma 2's layer.)"""

    def __init__(self, layer_num: int, tp_rank: int, world_size: int, network_config):
        super().__init__(layer_num, tp_rank, world_size, network_config)
        self.logit_softcap_ = 0.0

    def _rotary_tables(self, infer_state: Gemma3InferStateInfo) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_sliding_:
            return infer_state.local_cos, infer_state.local_sin
        return super()._rotary_tables(infer_state)
