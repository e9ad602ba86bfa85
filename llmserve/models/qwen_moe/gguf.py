"""How llama.cpp's ``qwen2moe`` and ``qwen3moe`` GGUF files name their tensors and config.

Each layer's experts are stacked in one tensor per projection (``ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps``: ``[experts, out, in]``), read back as HF's ``mlp.experts.E.*`` one expert at a
time; the router is ``ffn_gate_inp``; Qwen2-MoE's shared expert is ``ffn_*_shexp`` with its sigmoid
gate ``ffn_gate_inp_shexp`` (a vector in the file, a ``[1, hidden]`` matrix in HF). The experts'
width is ``expert_feed_forward_length`` (HF's ``moe_intermediate_size``). llama.cpp always
renormalises Qwen3-MoE's top-k weights (``norm_topk_prob``, false in HF's config class default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.basemodel.layer_weights.gguf_load_utils import GGUFArch
from llmserve.models.llama.gguf import BLOCK_TENSORS, GLOBAL_TENSORS

EXPERT_TENSORS: dict[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}
SHARED_EXPERT_TENSORS: dict[str, str] = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def _experts_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {"num_experts": meta["expert_count"], "num_experts_per_tok": meta["expert_used_count"],
            "moe_intermediate_size": meta["expert_feed_forward_length"]}


def _qwen2moe_config(tensor_shapes: Mapping[str, tuple[int, ...]], meta: Mapping[str, Any]) -> dict[str, Any]:
    config = _experts_config(meta)
    config["shared_expert_intermediate_size"] = meta.get("expert_shared_feed_forward_length", 0)
    return config


def _qwen3moe_config(tensor_shapes: Mapping[str, tuple[int, ...]], meta: Mapping[str, Any]) -> dict[str, Any]:
    return {**_experts_config(meta), "norm_topk_prob": True}


GGUF_ARCHS: dict[str, GGUFArch] = {
    "qwen2moe": GGUFArch("qwen2_moe", "Qwen2MoeForCausalLM", permuted_qk=False, global_tensors=GLOBAL_TENSORS,
                         block_tensors={**BLOCK_TENSORS, **EXPERT_TENSORS, **SHARED_EXPERT_TENSORS},
                         extra_config=_qwen2moe_config),
    "qwen3moe": GGUFArch("qwen3_moe", "Qwen3MoeForCausalLM", permuted_qk=False, global_tensors=GLOBAL_TENSORS,
                         block_tensors={**BLOCK_TENSORS, **EXPERT_TENSORS, **QK_NORMS}, extra_config=_qwen3moe_config),
}
