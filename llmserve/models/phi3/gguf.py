"""How llama.cpp's ``phi3`` GGUF files name their tensors: Llama's names, with q, k, v fused in
``blk.N.attn_qkv`` and gate, up in ``blk.N.ffn_up`` (gate first), as in HF's ``qkv_proj`` and
``gate_up_proj``; q and k are not permuted.

Files whose rotary has LongRoPE factors (``rope_factors_long`` / ``rope_factors_short`` tensors:
Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) are refused: the loader does not yet turn those tensors
into the HF config's factors. The metadata's ``rope.dimension_count`` is the rotary width, not the
head size, so the head size is left to the config (hidden / heads, as for every Phi-3)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.basemodel.layer_weights.gguf_load_utils import GGUFArch, ModelLoadError
from llmserve.models.llama.gguf import BLOCK_TENSORS, GLOBAL_TENSORS

ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _phi3_config(tensor_shapes: Mapping[str, tuple[int, ...]], meta: Mapping[str, Any]) -> dict[str, Any]:
    if any(name in tensor_shapes for name in ROPE_FACTORS):
        raise ModelLoadError("phi3 GGUF files with LongRoPE factors (rope_factors_long / rope_factors_short) are not "
                             "supported yet; serve the Hugging Face checkpoint instead")
    return {"head_dim": None}


GGUF_ARCHS: dict[str, GGUFArch] = {
    "phi3": GGUFArch("phi3", "Phi3ForCausalLM", permuted_qk=False, global_tensors=GLOBAL_TENSORS,
                     block_tensors={**BLOCK_TENSORS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     extra_config=_phi3_config),
}
