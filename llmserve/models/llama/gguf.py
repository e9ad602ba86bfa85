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


def _llama_config(tensor_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in tensor_shapes, "mlp_bias": False}


GGUF_ARCHS: dict[str, GGUFArch] = {
    # "llama" also covers Mistral and SmolLM2, which llama.cpp converts as llama.
    "llama": GGUFArch("llama", "LlamaForCausalLM", permuted_qk=True, global_tensors=GLOBAL_TENSORS,
                      block_tensors=BLOCK_TENSORS, extra_config=_llama_config),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", permuted_qk=False, global_tensors=GLOBAL_TENSORS,
                      block_tensors=BLOCK_TENSORS),     # q/k/v carry biases
}
