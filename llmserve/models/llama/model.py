from __future__ import annotations

from llmserve.common.basemodel import TpPartBaseModel
from llmserve.common.rotary_embedding import RotaryEmbedding, rope_type
from llmserve.models.llama.gguf import GGUF_ARCHS
from llmserve.models.llama.infer_struct import LlamaInferStateInfo
from llmserve.models.llama.layer_infer.post_layer_infer import LlamaPostLayerInfer
from llmserve.models.llama.layer_infer.pre_layer_infer import LlamaPreLayerInfer
from llmserve.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer
from llmserve.models.llama.layer_weights.pre_and_post_layer_weight import LlamaPreAndPostLayerWeight
from llmserve.models.llama.layer_weights.transformer_layer_weight import LlamaTransformerLayerWeight


class LlamaTpPartModel(TpPartBaseModel):
    """Llama 2 / 3, Mistral, Qwen2 and SmolLM2: one implementation, the differences (GQA, q/k/v
    bias, rope scaling, tied embeddings) all come from the config."""

    pre_and_post_weight_class = LlamaPreAndPostLayerWeight
    transformer_weight_class = LlamaTransformerLayerWeight

    pre_layer_infer_class = LlamaPreLayerInfer
    post_layer_infer_class = LlamaPostLayerInfer
    transformer_layer_infer_class = LlamaTransformerLayerInfer

    infer_state_class = LlamaInferStateInfo
    gguf_archs = GGUF_ARCHS

    def _verify_params(self) -> None:
        cfg = self.network_config_
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{cfg.model_type}: hidden_act {act!r} is not supported (only silu)")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError(f"{cfg.model_type}: mlp_bias is not supported")
        window = getattr(cfg, "sliding_window", None)
        if window and (cfg.model_type in ("mistral", "mixtral") or getattr(cfg, "use_sliding_window", False)):
            # Sliding-window attention is not implemented; within the window it is plain causal
            # attention, so requests are capped at the window rather than silently diverging.
            self.params.max_seq_len = min(self.params.max_seq_len or window, window)

    def _graphs_supported(self) -> bool:
        # Dynamic NTK rotary computes its table on the host once a sequence outgrows the trained
        # context; a captured step cannot.
        return rope_type(self.network_config_) != "dynamic"

    def _init_custom(self) -> None:
        self.rotary_emb = RotaryEmbedding(self.network_config_, self.device, self.max_seq_len)
