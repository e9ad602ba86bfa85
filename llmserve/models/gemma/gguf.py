"""How llama.cpp's ``gemma``, ``gemma2`` and ``gemma3`` GGUF files name their tensors and config.

Llama's tensor names, plus Gemma 2's extra norms around attention and the MLP
(``post_attention_norm``, ``post_ffw_norm``; ``ffn_norm`` is then the pre-feed-forward norm, HF's
``pre_feedforward_layernorm``) and Gemma 3's per-head q/k norms. q and k are not permuted (llama.cpp
runs Gemma's rotary as HF does, on halves). Every norm weight is stored as 1 + w (``norm_offset``).

What the metadata leaves out, filled in as llama.cpp's own loader does: the GELU is the tanh
approximation; Gemma 2's soft-caps default to 50 / 30 when a file predates those keys; the query
scale (HF's ``query_pre_attn_scalar``) is hidden / heads for the 27B models (46 layers for Gemma 2,
62 for Gemma 3) and the head size for every other size; Gemma 3's sliding layers (five of every six)
rotate with base 10000, the HF config's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.basemodel.layer_weights.gguf_load_utils import GGUFArch
from llmserve.models.llama.gguf import BLOCK_TENSORS, GLOBAL_TENSORS

GEMMA2_BLOCK_TENSORS: dict[str, str] = {
    **BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA3_BLOCK_TENSORS: dict[str, str] = {
    **GEMMA2_BLOCK_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

# The layer counts of the 27B models, whose queries llama.cpp scales by hidden / heads.
LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def _gemma_config(tensor_shapes: Mapping[str, tuple[int, ...]], meta: Mapping[str, Any]) -> dict[str, Any]:
    return {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}


def _query_scale(meta: Mapping[str, Any], arch: str) -> int:
    hidden, heads = meta["embedding_length"], meta["attention.head_count"]
    head_dim = meta.get("attention.key_length", hidden // heads)
    return hidden // heads if meta["block_count"] == LAYERS_27B[arch] else head_dim


def _gemma2_config(tensor_shapes: Mapping[str, tuple[int, ...]], meta: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **_gemma_config(tensor_shapes, meta),
        "query_pre_attn_scalar": _query_scale(meta, "gemma2"),
        "attn_logit_softcapping": meta.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": meta.get("final_logit_softcapping", 30.0),
        "sliding_window": meta.get("attention.sliding_window", 4096),
    }


def _gemma3_config(tensor_shapes: Mapping[str, tuple[int, ...]], meta: Mapping[str, Any]) -> dict[str, Any]:
    config = {**_gemma_config(tensor_shapes, meta), "query_pre_attn_scalar": _query_scale(meta, "gemma3")}
    if "attention.sliding_window" in meta:
        config["sliding_window"] = meta["attention.sliding_window"]
    if "final_logit_softcapping" in meta:
        config["final_logit_softcapping"] = meta["final_logit_softcapping"]
    return config


GGUF_ARCHS: dict[str, GGUFArch] = {
    "gemma": GGUFArch("gemma", "GemmaForCausalLM", permuted_qk=False, global_tensors=GLOBAL_TENSORS,
                      block_tensors=BLOCK_TENSORS, extra_config=_gemma_config, norm_offset=1.0),
    "gemma2": GGUFArch("gemma2", "Gemma2ForCausalLM", permuted_qk=False, global_tensors=GLOBAL_TENSORS,
                       block_tensors=GEMMA2_BLOCK_TENSORS, extra_config=_gemma2_config, norm_offset=1.0),
    "gemma3": GGUFArch("gemma3_text", "Gemma3ForCausalLM", permuted_qk=False, global_tensors=GLOBAL_TENSORS,
                       block_tensors=GEMMA3_BLOCK_TENSORS, extra_config=_gemma3_config, norm_offset=1.0),
}
