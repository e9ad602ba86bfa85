from __future__ import annotations

from llmserve.kernels.qk_rmsnorm import QKNorm
from llmserve.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer


class Qwen3TransformerLayerInfer(LlamaTransformerLayerInfer):
    """Llama's layer with each head of q and of k RMS-normalised (over its ``head_dim``) before
    rotary, by the launch that rotates and stores them (``_store_kv``)."""

    def _qk_norm(self, layer_weight) -> QKNorm:
        return QKNorm(layer_weight.q_norm_weight_, layer_weight.k_norm_weight_, self.eps_, self.norm_round_first)
