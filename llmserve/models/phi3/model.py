from __future__ import annotations

from llmserve.models.llama.model import LlamaTpPartModel
from llmserve.models.phi3.gguf import GGUF_ARCHS
from llmserve.models.phi3.infer_struct import Phi3InferStateInfo
from llmserve.models.phi3.layer_weights.transformer_layer_weight import Phi3TransformerLayerWeight


class Phi3TpPartModel(LlamaTpPartModel):
    """Phi-3, Phi-3.5 and Phi-4-mini: a Llama layer stored with fused ``qkv_proj`` and
    ``gate_up_proj`` (split per rank at load), LongRoPE switched per request by its length, and
    partial rotary (Phi-4-mini's 0.75) by the order of q and k's rows. The rest (GQA, tied or
    untied embeddings, SiLU MLP, the sliding window HF applies whenever the config sets one:
    Phi-3-mini-4k's 2047) is Llama's."""

    transformer_weight_class = Phi3TransformerLayerWeight
    infer_state_class = Phi3InferStateInfo
    gguf_archs = GGUF_ARCHS
