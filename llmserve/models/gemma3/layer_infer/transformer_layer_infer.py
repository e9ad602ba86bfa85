from __future__ import annotations

import torch

from llmserve.kernels import rotary_emb_copy_kv
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

    def _store_kv(self, q: torch.Tensor, kv: torch.Tensor, infer_state: Gemma3InferStateInfo, layer_weight) -> None:
        if not self.is_sliding_:
            return super()._store_kv(q, kv, infer_state, layer_weight)
        rotary_emb_copy_kv(q, kv, infer_state.local_cos, infer_state.local_sin, infer_state.mem_index,
                           infer_state.mem_manager.kv_buffer[self.layer_num_], **self._kv_scales(infer_state),
                           qk_norm=self._qk_norm(layer_weight))
