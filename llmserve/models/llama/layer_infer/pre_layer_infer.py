from llmserve.common.basemodel import PreLayerInferTpl


class LlamaPreLayerInfer(PreLayerInferTpl):
    """Plain vocab-parallel embedding lookup (no embedding norm)."""
