from __future__ import annotations

from llmserve.models.gemma.model import GemmaTpPartModel
from llmserve.models.gemma2.layer_infer.transformer_layer_infer import Gemma2TransformerLayerInfer
from llmserve.models.gemma2.layer_weights.transformer_layer_weight import Gemma2TransformerLayerWeight


class Gemma2TpPartModel(GemmaTpPartModel):
    """Gemma 2: Gemma's layer with post-attention and post-MLP norms, attention-score and
    final-logit soft-capping, ``query_pre_attn_scalar`` and sliding windows on alternate layers.

    The KV cache keeps every token of a request, also those that left a sliding layer's window:
    half the layers are global and read all of them, so freeing the others would save at most
    half a request's slots, only past the window (4096 tokens), and would need per-layer slot
    tables. Families whose every layer slides (Mistral) are where freeing would pay."""

    transformer_weight_class = Gemma2TransformerLayerWeight
    transformer_layer_infer_class = Gemma2TransformerLayerInfer
