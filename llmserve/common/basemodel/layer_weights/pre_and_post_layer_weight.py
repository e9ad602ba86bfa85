from __future__ import annotations

from llmserve.common.basemodel.layer_weights.base_layer_weight import BaseLayerWeight


class PreAndPostLayerWeight(BaseLayerWeight):
    """Weights outside the transformer layers: the token embedding (vocab-parallel), the final
    norm and the lm_head. Subclasses name them in ``weight_specs`` and set ``wte_weight_``,
    ``lm_head_weight_`` and the norm weights in ``_build``.

    A pipeline stage holds only its share (set by the model before loading): stage 0 the
    embedding (``holds_pre_``), the last stage the final norm and the lm_head (``holds_post_``),
    a tied one loading the embedding's tensor for it. A subclass that ignores them serves pp=1
    only (models/registry.py, PIPELINE_MODEL_TYPES)."""

    holds_pre_: bool = True
    holds_post_: bool = True
