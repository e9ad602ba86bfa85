from __future__ import annotations

from llmserve.common.basemodel.moe import MoeLayerInfer, MoeLayerWeight, MoeLayout
from llmserve.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer
from llmserve.models.llama.layer_weights.transformer_layer_weight import LlamaTransformerLayerWeight
from llmserve.models.llama.model import LlamaTpPartModel
from llmserve.models.qwen3.layer_infer.transformer_layer_infer import Qwen3TransformerLayerInfer
from llmserve.models.qwen3.layer_weights.transformer_layer_weight import Qwen3TransformerLayerWeight
from llmserve.models.qwen3.model import Qwen3TpPartModel
from llmserve.models.qwen_moe.gguf import GGUF_ARCHS


class QwenMoeLayerWeight(MoeLayerWeight):
    """Qwen-MoE's experts (``mlp.experts.E.gate_proj`` ...), renormalised iff ``norm_topk_prob``.
    A layer is dense (``mlp.gate_proj`` ..., ``intermediate_size`` wide) when listed in
    ``mlp_only_layers`` or off the ``decoder_sparse_step`` stride, as HF decides."""

    shared_expert = False

    def moe_layout(self) -> MoeLayout | None:
        cfg, i = self.network_config_, self.layer_num_
        if i in (getattr(cfg, "mlp_only_layers", None) or []) or not (
                cfg.num_experts > 0 and (i + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0):
            return None
        return MoeLayout(f"model.layers.{i}.mlp.", cfg.num_experts, cfg.num_experts_per_tok,
                         renormalize=bool(cfg.norm_topk_prob), shared_expert=self.shared_expert)


class Qwen2MoeTransformerLayerWeight(QwenMoeLayerWeight, LlamaTransformerLayerWeight):
    """Qwen2's layer (q/k/v bias) with Qwen-MoE's MLP, plus its shared expert under a sigmoid gate."""

    shared_expert = True


class Qwen3MoeTransformerLayerWeight(QwenMoeLayerWeight, Qwen3TransformerLayerWeight):
    pass


class Qwen2MoeTransformerLayerInfer(MoeLayerInfer, LlamaTransformerLayerInfer):
    pass


class Qwen3MoeTransformerLayerInfer(MoeLayerInfer, Qwen3TransformerLayerInfer):
    pass


class Qwen2MoeTpPartModel(LlamaTpPartModel):
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, routed experts and a shared one."""

    transformer_weight_class = Qwen2MoeTransformerLayerWeight
    transformer_layer_infer_class = Qwen2MoeTransformerLayerInfer
    gguf_archs = GGUF_ARCHS


class Qwen3MoeTpPartModel(Qwen3TpPartModel):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms) and routed experts."""

    transformer_weight_class = Qwen3MoeTransformerLayerWeight
    transformer_layer_infer_class = Qwen3MoeTransformerLayerInfer
    gguf_archs = GGUF_ARCHS
