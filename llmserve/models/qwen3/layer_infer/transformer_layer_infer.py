from __future__ import annotations

import torch

from llmserve.kernels import qk_rmsnorm_
from llmserve.models.llama.infer_struct import LlamaInferStateInfo
from llmserve.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer


class Qwen3TransformerLayerInfer(LlamaTransformerLayerInfer):
    """Llama's layer with each head of q and of k RMS-normalised (over its ``head_dim``) before
    rotary: the norms run on the projection's output, then ``_store_kv`` rotates and stores as
    Llama's does."""

    def _get_qkv(self, x: torch.Tensor, infer_state: LlamaInferStateInfo,
                 layer_weight) -> tuple[torch.Tensor, torch.Tensor]:
        q, kv = super()._get_qkv(x, infer_state, layer_weight)
        # The norms' rows are the heads ([n, H, D]); q and k are normalised in place, in their
        # columns of the fused projection (kv keeps K and V side by side for the one store), by
        # one launch for both.
        qk_rmsnorm_(q, kv[:, : self.tp_kv_head_num_], layer_weight.q_norm_weight_, layer_weight.k_norm_weight_,
                    self.eps_, self.norm_round_first)
        return q, kv
