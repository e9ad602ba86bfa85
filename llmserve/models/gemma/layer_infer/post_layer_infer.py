from llmserve.models.llama.layer_infer.post_layer_infer import LlamaPostLayerInfer


class GemmaPostLayerInfer(LlamaPostLayerInfer):
    """Llama's, with GemmaRMSNorm's rounding (the weight is the fp32 1 + w). Gemma 2's final-logit
    soft-capping comes from its config, in the template."""

    norm_round_first = False
