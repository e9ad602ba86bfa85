from __future__ import annotations

from llmserve.common.basemodel.moe import MoeLayerInfer, MoeLayerWeight, MoeLayout
from llmserve.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer
from llmserve.models.llama.layer_weights.transformer_layer_weight import LlamaTransformerLayerWeight
from llmserve.models.llama.model import LlamaTpPartModel


class MixtralTransformerLayerWeight(MoeLayerWeight, LlamaTransformerLayerWeight):
    """Mistral's layer with every MLP a ``block_sparse_moe``: experts ``w1`` (gate), ``w3`` (up)
    and ``w2`` (down), the top-k weights always renormalised."""

    def moe_layout(self) -> MoeLayout:
        cfg = self.network_config_
        return MoeLayout(f"model.layers.{self.layer_num_}.block_sparse_moe.", cfg.num_local_experts,
                         cfg.num_experts_per_tok, renormalize=True, expert_names=("w1", "w3", "w2"))


class MixtralTransformerLayerInfer(MoeLayerInfer, LlamaTransformerLayerInfer):
    pass


class MixtralTpPartModel(LlamaTpPartModel):
    """Mixtral: Mistral's attention (GQA, rotary, a sliding window capping requests) and a
    mixture-of-experts MLP in every layer."""

    transformer_weight_class = MixtralTransformerLayerWeight
    transformer_layer_infer_class = MixtralTransformerLayerInfer
    # Mixtral GGUF files are llama.cpp's ``llama`` architecture with experts (Llama's table reads them).
