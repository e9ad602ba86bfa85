from __future__ import annotations

import torch

from llmserve.common.basemodel import TransformerLayerWeight, WeightSpec
from llmserve.common.basemodel.layer_weights.base_layer_weight import Weight
from llmserve.kernels.quantized_linear import stack_rows


class LlamaTransformerLayerWeight(TransformerLayerWeight):
    """Llama / Mistral / Qwen2 / SmolLM2 layer. q, k, v are fused into one column-parallel matmul
    and gate, up into another; o and down are row-parallel."""

    def weight_specs(self) -> dict[str, WeightSpec]:
        cfg = self.network_config_
        p = f"model.layers.{self.layer_num_}."
        qkv_bias = (cfg.model_type == "qwen2" or bool(getattr(cfg, "qkv_bias", False))  # qkv_bias: Qwen2-MoE
                    or bool(getattr(cfg, "attention_bias", False)))
        return {
            "att_norm": WeightSpec(p + "input_layernorm.weight"),
            "q": WeightSpec(p + "self_attn.q_proj.weight", "col"),
            "k": WeightSpec(p + "self_attn.k_proj.weight", "col"),
            "v": WeightSpec(p + "self_attn.v_proj.weight", "col"),
            "q_bias": WeightSpec(p + "self_attn.q_proj.bias", "col", required=qkv_bias),
            "k_bias": WeightSpec(p + "self_attn.k_proj.bias", "col", required=qkv_bias),
            "v_bias": WeightSpec(p + "self_attn.v_proj.bias", "col", required=qkv_bias),
            "o": WeightSpec(p + "self_attn.o_proj.weight", "row"),
            "o_bias": WeightSpec(p + "self_attn.o_proj.bias", required=False),
            "ffn_norm": WeightSpec(p + "post_attention_layernorm.weight"),
            **self.ffn_specs(),
        }

    def ffn_specs(self) -> dict[str, WeightSpec]:
        """The MLP's tensors (a mixture-of-experts layer has others: see ``MoeLayerWeight``)."""
        p = f"model.layers.{self.layer_num_}.mlp."
        return {
            "gate": WeightSpec(p + "gate_proj.weight", "col"),
            "up": WeightSpec(p + "up_proj.weight", "col"),
            "down": WeightSpec(p + "down_proj.weight", "row"),
        }

    def _build(self, w: dict[str, Weight]) -> None:
        self.att_norm_weight_ = w["att_norm"]
        self.qkv_weight_ = stack_rows([w["q"], w["k"], w["v"]])
        self.qkv_bias_ = torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]]) if "q_bias" in w else None
        self.o_weight_ = w["o"]
        self.o_bias_ = w.get("o_bias")
        self.ffn_norm_weight_ = w["ffn_norm"]
        self._build_ffn(w)

    def _build_ffn(self, w: dict[str, Weight]) -> None:
        self.gate_up_weight_ = stack_rows([w["gate"], w["up"]])
        self.down_weight_ = w["down"]
