from __future__ import annotations

from llmserve.common.rotary_embedding import RotaryEmbedding, rope_type
from llmserve.models.gemma2.model import Gemma2TpPartModel
from llmserve.models.gemma3.infer_struct import Gemma3InferStateInfo
from llmserve.models.gemma3.layer_infer.transformer_layer_infer import Gemma3TransformerLayerInfer
from llmserve.models.gemma3.layer_weights.transformer_layer_weight import Gemma3TransformerLayerWeight

GLOBAL, LOCAL = "full_attention", "sliding_attention"


class Gemma3TpPartModel(Gemma2TpPartModel):
    """Gemma 3, text (``gemma3_text``: Gemma3ForCausalLM, the 1B and the text part of the larger
    ones): Gemma 2's layer with q/k norms, five sliding layers to one global (``layer_types``),
    and two rotary tables: the sliding layers' own base, the global layers' base and scaling
    (``rope_parameters`` by layer type). Soft-capping is off unless the config sets it."""

    transformer_weight_class = Gemma3TransformerLayerWeight
    transformer_layer_infer_class = Gemma3TransformerLayerInfer
    infer_state_class = Gemma3InferStateInfo

    def _graphs_supported(self) -> bool:
        return "dynamic" not in (rope_type(self.network_config_, GLOBAL), rope_type(self.network_config_, LOCAL))

    def _init_custom(self) -> None:
        self.rotary_emb = RotaryEmbedding(self.network_config_, self.device, self.max_seq_len, layer_type=GLOBAL)
        self.local_rotary_emb = RotaryEmbedding(self.network_config_, self.device, self.max_seq_len, layer_type=LOCAL)
