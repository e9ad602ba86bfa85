"""How llama.cpp's GGUF files of the architectures this folder serves name their tensors and
config, for the generic loader (``llmserve.common.basemodel.layer_weights.gguf_load_utils``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.basemodel.layer_weights.gguf_load_utils import GGUFArch

GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

BLOCK_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# llama.cpp converts Mixtral as ``llama`` with experts: a router ``ffn_gate_inp`` and each
# projection's experts stacked as ``[experts, out, in]``, HF's ``block_sparse_moe.experts.E.w1``
# (gate), ``w3`` (up) and ``w2`` (down).
MIXTRAL_TENSORS: dict[str, str] = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
}


def _llama_config(tensor_shapes: Mapping[str, tuple[int, ...]], meta: Mapping[str, Any]) -> dict[str, Any]:
    config = {"attention_bias": "blk.0.attn_q.bias" in tensor_shapes, "mlp_bias": False}
    if meta.get("expert_count", 0) > 0:
        config.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
                      num_local_experts=meta["expert_count"], num_experts_per_tok=meta["expert_used_count"])
    return config


GGUF_ARCHS: dict[str, GGUFArch] = {
    # "llama" also covers Mistral and SmolLM2, which llama.cpp converts as llama.
    "llama": GGUFArch("llama", "LlamaForCausalLM", permuted_qk=True, global_tensors=GLOBAL_TENSORS,
                      block_tensors={**BLOCK_TENSORS, **MIXTRAL_TENSORS}, extra_config=_llama_config),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", permuted_qk=False, global_tensors=GLOBAL_TENSORS,
                      block_tensors=BLOCK_TENSORS),     # q/k/v carry biases
}
