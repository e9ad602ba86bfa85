from __future__ import annotations

from llmserve.models.llama.model import LlamaTpPartModel
from llmserve.models.qwen3.gguf import GGUF_ARCHS
from llmserve.models.qwen3.layer_infer.transformer_layer_infer import Qwen3TransformerLayerInfer
from llmserve.models.qwen3.layer_weights.transformer_layer_weight import Qwen3TransformerLayerWeight


class Qwen3TpPartModel(LlamaTpPartModel):
    """Qwen3 (dense): a Llama layer whose q and k heads are each RMS-normalised before rotary. The
    rest (GQA, an explicit ``head_dim``, tied or untied embeddings, rope scaling, no q/k/v bias)
    comes from the config through Llama's code."""

    transformer_weight_class = Qwen3TransformerLayerWeight
    transformer_layer_infer_class = Qwen3TransformerLayerInfer
    gguf_archs = GGUF_ARCHS
