from __future__ import annotations

import torch

from llmserve.kernels import rmsnorm_forward
from llmserve.models.llama.infer_struct import LlamaInferStateInfo
from llmserve.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer


class Qwen3TransformerLayerInfer(LlamaTransformerLayerInfer):
    """Llama's layer with each head of q and of k RMS-normalised (over its ``head_dim``) before
    rotary: the norms run on the projection's output, then ``_store_kv`` rotates and stores as
    Llama's does."""

    def _get_qkv(self, x: torch.Tensor, infer_state: LlamaInferStateInfo,
                 layer_weight) -> tuple[torch.Tensor, torch.Tensor]:
        q, kv = super()._get_qkv(x, infer_state, layer_weight)
        # The norm's rows are the heads ([n, H, D] -> n * H rows of D). k is normalised in place,
        # in its columns of the fused projection, because kv keeps K and V side by side for the
        # one store; q may become a new tensor, as nothing else reads the projection's copy.
        # On a GPU this is five launches a layer (q and k are strided views: each is gathered
        # into rows, normalised, and k written back); one kernel doing the norms inside the
        # rotary-and-store launch would save them all, if a profile shows them.
        k = kv[:, : self.tp_kv_head_num_]
        k.copy_(rmsnorm_forward(k, layer_weight.k_norm_weight_, self.eps_, self.norm_round_first))
        return rmsnorm_forward(q, layer_weight.q_norm_weight_, self.eps_, self.norm_round_first), kv
