from __future__ import annotations

import torch

from llmserve.kernels import rmsnorm_forward, rotary_emb_copy_kv
from llmserve.models.gemma2.layer_infer.transformer_layer_infer import Gemma2TransformerLayerInfer
from llmserve.models.gemma3.infer_struct import Gemma3InferStateInfo


class Gemma3TransformerLayerInfer(Gemma2TransformerLayerInfer):
    """Gemma 2's layer with each head of q and k RMS-normalised before rotary (as Qwen3's, with
    Gemma's norm), the sliding layers rotating with their own tables. The window pattern comes
    from the config; attention scores are never soft-capped: HF's Gemma3Attention keeps the
    config's ``attn_logit_softcapping`` but does not apply it (the final-logit cap it applies)."""

    def __init__(self, layer_num: int, tp_rank: int, world_size: int, network_config):
        super().__init__(layer_num, tp_rank, world_size, network_config)
        self.logit_softcap_ = 0.0

    def _get_qkv(self, x: torch.Tensor, infer_state: Gemma3InferStateInfo,
                 layer_weight) -> tuple[torch.Tensor, torch.Tensor]:
        q, kv = super()._get_qkv(x, infer_state, layer_weight)
        # k in place inside kv (stored in one piece by _store_kv); see Qwen3TransformerLayerInfer.
        k = kv[:, : self.tp_kv_head_num_]
        k.copy_(rmsnorm_forward(k, layer_weight.k_norm_weight_, self.eps_, round_first=False))
        return rmsnorm_forward(q, layer_weight.q_norm_weight_, self.eps_, round_first=False), kv

    def _store_kv(self, q: torch.Tensor, kv: torch.Tensor, infer_state: Gemma3InferStateInfo, layer_weight) -> None:
        if not self.is_sliding_:
            return super()._store_kv(q, kv, infer_state, layer_weight)
        rotary_emb_copy_kv(q, kv, infer_state.local_cos, infer_state.local_sin, infer_state.mem_index,
                           infer_state.mem_manager.kv_buffer[self.layer_num_])
