"""Tiny GGUF files as llama.cpp's converter writes them, for the GGUF loader's and the quantized
CPU path's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 32, 64, 2, 4, 2, 40
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_tensors(rng: np.random.Generator, biases: bool, untied: bool) -> dict[str, np.ndarray]:
    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    t = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if untied:
        t["lm_head.weight"] = rand(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = rand(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = rand(HIDDEN)
        t[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        t[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        t[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
        if biases:
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                t[p + f"self_attn.{proj}_proj.bias"] = rand(rows * HEAD_DIM)
    return t


GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",     # qwen3
}


def to_gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, idx, rest = stem.split(".", 3)
        return f"blk.{idx}.{GGUF_NAMES[rest]}.{suffix}"
    return f"{GGUF_NAMES[stem]}.{suffix}"


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
    extra_kv: Callable[[gguf.GGUFWriter], None] | None = None,
    head_dim: int = HEAD_DIM,
) -> None:
    """A GGUF file as llama.cpp's converter would write it (q/k permuted for llama). A ``head_dim``
    other than HIDDEN / HEADS is written as the converter does (``attention.key_length``)."""
    quantize = quantize or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    if head_dim != HEAD_DIM:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if extra_kv:
        extra_kv(w)
    for name, value in tensors.items():
        gguf_name = to_gguf_name(name) if not name.startswith(("rope_freqs", "blk.")) else name
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            value = llama_cpp_permute(value, HEADS if ".attn_q." in gguf_name else KV_HEADS)
        qtype = quantize.get(name)
        if qtype is None:
            w.add_tensor(gguf_name, value)
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# HF model_type -> the llama.cpp architecture its converter writes.
CONVERTER_ARCHS = {
    "gemma": gguf.MODEL_ARCH.GEMMA, "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "mixtral": gguf.MODEL_ARCH.LLAMA,
}


def write_converted_gguf(path: Path, config, hf_tensors: dict[str, np.ndarray], norm_shift: float = 0.0,
                         extra_kv: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
    """``hf_tensors`` (a checkpoint's names: one tensor per expert) as llama.cpp's converter writes
    them for ``config.model_type``: named by gguf-py's own HF -> GGUF map (the converter's), each
    projection's experts stacked in one ``[experts, out, in]`` tensor, norm weights plus
    ``norm_shift`` (Gemma's 1), q/k permuted for ``llama``; the metadata its model needs."""
    import re

    arch = CONVERTER_ARCHS[config.model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, value in hf_tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(.*)", name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = value
        else:
            tensors[name] = value + np.float32(norm_shift) if name.endswith("norm.weight") else value
    tensors |= {name: np.stack([per[e] for e in sorted(per)]) for name, per in experts.items()}

    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = config.rope_parameters
    w.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))     # Gemma 3: the global layers' base
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if extra_kv:
        extra_kv(w)
    for name, value in tensors.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if arch == gguf.MODEL_ARCH.LLAMA and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
            value = llama_cpp_permute(value, heads)
        w.add_tensor(gguf_name, np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def checkpoint_tensors(directory: Path) -> dict[str, np.ndarray]:
    """The tensors of a saved HF checkpoint as stored (transformers 5 saves experts one by one)."""
    from safetensors.numpy import load_file

    return load_file(str(directory / "model.safetensors"))
