from __future__ import annotations

from llmserve.common.basemodel.layer_weights.base_layer_weight import BaseLayerWeight


class PreAndPostLayerWeight(BaseLayerWeight):
    """Weights outside the transformer layers: the token embedding (vocab-parallel), the final
    norm and the lm_head. Subclasses name them in ``weight_specs`` and set ``wte_weight_``,
    ``lm_head_weight_`` and the norm weights in ``_build``."""
