from __future__ import annotations

from llmserve.models.gemma.layer_infer.post_layer_infer import GemmaPostLayerInfer
from llmserve.models.gemma.layer_infer.pre_layer_infer import GemmaPreLayerInfer
from llmserve.models.gemma.layer_infer.transformer_layer_infer import GemmaTransformerLayerInfer
from llmserve.models.gemma.layer_weights.pre_and_post_layer_weight import GemmaPreAndPostLayerWeight
from llmserve.models.gemma.gguf import GGUF_ARCHS
from llmserve.models.gemma.layer_weights.transformer_layer_weight import GemmaTransformerLayerWeight
from llmserve.models.llama.model import LlamaTpPartModel

# (GemmaConfig itself turns Gemma 1's legacy "gelu" into gelu_pytorch_tanh; for Gemma 2 / 3 "gelu"
# would be the exact GELU, which the GeGLU kernel does not compute.)
GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh")


class GemmaTpPartModel(LlamaTpPartModel):
    """Gemma (1): a Llama layer with the embedding scaled by sqrt(hidden_size), RMSNorm by
    ``1 + w`` in fp32, a GeGLU MLP (tanh GELU) and tied embeddings. Gemma 2 and 3 build on it."""

    pre_and_post_weight_class = GemmaPreAndPostLayerWeight
    transformer_weight_class = GemmaTransformerLayerWeight
    pre_layer_infer_class = GemmaPreLayerInfer
    post_layer_infer_class = GemmaPostLayerInfer
    transformer_layer_infer_class = GemmaTransformerLayerInfer
    gguf_archs = GGUF_ARCHS

    def _verify_params(self) -> None:
        cfg = self.network_config_
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act not in GELU_TANH:
            raise ValueError(f"{cfg.model_type}: hidden activation {act!r} is not supported (only gelu_pytorch_tanh)")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(f"{cfg.model_type}: use_bidirectional_attention (an embedding model) is not supported")
