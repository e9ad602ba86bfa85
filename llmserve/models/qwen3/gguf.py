"""How llama.cpp's ``qwen3`` GGUF files name their tensors: Llama's names plus each layer's q/k
norms (``blk.N.attn_q_norm``, ``blk.N.attn_k_norm``). Like ``qwen2`` (and unlike ``llama``), the
converter leaves q and k in Hugging Face's row order; the head size is ``qwen3.attention.key_length``,
which the loader reads (Qwen3-0.6B's 128 is not its hidden size over its heads)."""

from __future__ import annotations

from llmserve.common.basemodel.layer_weights.gguf_load_utils import GGUFArch
from llmserve.models.llama.gguf import BLOCK_TENSORS, GLOBAL_TENSORS

GGUF_ARCHS: dict[str, GGUFArch] = {
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", permuted_qk=False, global_tensors=GLOBAL_TENSORS,
                      block_tensors={**BLOCK_TENSORS, "attn_q_norm": "self_attn.q_norm",
                                     "attn_k_norm": "self_attn.k_norm"}),
}
