from __future__ import annotations

from llmserve.models.llama.model import LlamaTpPartModel
from llmserve.models.phi3.gguf import GGUF_ARCHS
from llmserve.models.phi3.infer_struct import Phi3InferStateInfo
from llmserve.models.phi3.layer_weights.transformer_layer_weight import Phi3TransformerLayerWeight


class Phi3TpPartModel(LlamaTpPartModel):
    """Phi-3, Phi-3.5 and Phi-4-mini: a Llama layer stored with fused ``qkv_proj`` and
    ``gate_up_proj`` (split per rank at load), LongRoPE switched per request by its length, and
    partial rotary (Phi-4-mini's 0.75) by the order of q and k's rows. The rest (GQA, tied or
    untied embeddings, SiLU MLP) is Llama's."""

    transformer_weight_class = Phi3TransformerLayerWeight
    infer_state_class = Phi3InferStateInfo
    gguf_archs = GGUF_ARCHS

    def _verify_params(self) -> None:
        super()._verify_params()
        # HF applies Phi-3's sliding window whenever the config sets one (Phi-3-mini-4k: 2047).
        # Within the window it is plain causal attention; sliding windows are not implemented,
        # so requests are capped at the window rather than silently diverging.
        window = getattr(self.network_config_, "sliding_window", None)
        if window:
            self.params.max_seq_len = min(self.params.max_seq_len or window, window)
