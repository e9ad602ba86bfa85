"""Random weights named as a published checkpoint names them: ``--load-format dummy`` (vLLM's flag)
serves a model from its ``config.json`` alone, and the benchmarks draw the same weights in memory.

A model whose weights are random runs at the speed of the real one (the same shapes, bytes and
kernels), so a 70B-shaped model can be benchmarked on a machine that has no 140 GB checkpoint and
would take minutes to write one. The tokens it produces mean nothing.

Every rank draws every tensor whole, from one seeded generator, and keeps its share as it would
from a file: the weights are the same whatever the tensor-parallel size, so tp=2 can be checked
against tp=1 on them. The draw happens on the rank's device, one layer at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The families whose checkpoint layout ``random_hf_weights`` writes: Llama's (Mistral's is the same),
# with Qwen3's q/k norms, Gemma 2's four norms a layer, or Mixtral's / Qwen3-MoE's experts.
RANDOM_WEIGHT_MODEL_TYPES = frozenset({"llama", "mistral", "qwen3", "qwen3_moe", "mixtral", "gemma2"})

LOAD_FORMATS = ("auto", "dummy")


def check_load_format(load_format: str, model_type: str, model_path: str) -> None:
    """The edge's check of ``--load-format`` against the model it names (ValueError: the message)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    if load_format != "dummy":
        return
    if model_path.endswith(".gguf"):
        raise ValueError("--load-format dummy needs a model directory with a config.json, not a GGUF file")
    if model_type not in RANDOM_WEIGHT_MODEL_TYPES:
        raise ValueError(f"--load-format dummy draws weights for {', '.join(sorted(RANDOM_WEIGHT_MODEL_TYPES))} "
                         f"models; this one is {model_type!r}")


def random_hf_weights(cfg: Mapping, device: torch.device | str, dtype: torch.dtype,
                      scale: float = 0.02, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """HF-named random weights of ``cfg`` (an HF config as a dict), one dict per layer, the first
    holding the embedding, the final norm and the lm_head unless tied; matrices are normal with
    standard deviation ``scale``, norms leave their input's scale (1, or 0 for Gemma's 1 + w)."""
    import torch   # here, not above: the HTTP process checks --load-format without importing torch

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    model_type = cfg.get("model_type", "llama")   # llava.py's text config names none
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_dim, kv_dim = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(scale)

    gemma = model_type.startswith("gemma")

    def norm(n: int) -> torch.Tensor:
        return (torch.zeros if gemma else torch.ones)(n, dtype=dtype, device=device)

    yield {
        "model.embed_tokens.weight": normal(vocab, hidden),
        **({} if cfg.get("tie_word_embeddings") else {"lm_head.weight": normal(vocab, hidden)}),
        "model.norm.weight": norm(hidden),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield {
            p + "input_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": normal(q_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, q_dim),
            p + "post_attention_layernorm.weight": norm(hidden),
            **_random_mlp_weights(cfg, p, normal),
            **({p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim)}
               if model_type in ("qwen3", "qwen3_moe") else {}),
            **({p + "pre_feedforward_layernorm.weight": norm(hidden), p + "post_feedforward_layernorm.weight": norm(hidden)}
               if model_type == "gemma2" else {}),
        }


def _random_mlp_weights(cfg: Mapping, p: str, normal: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's MLP: dense, or Mixtral's / Qwen3-MoE's experts, one tensor per expert as
    published checkpoints store them."""
    hidden = cfg["hidden_size"]
    model_type = cfg.get("model_type", "llama")
    # Qwen3-MoE's config says num_experts, Mixtral's num_local_experts; transformers 5 writes either
    # as num_local_experts in to_dict().
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if model_type == "mixtral":
        p, names, inter = p + "block_sparse_moe.", ("w1", "w3", "w2"), cfg["intermediate_size"]
    elif model_type == "qwen3_moe":
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            raise ValueError("random Qwen3-MoE weights are drawn for configs with experts in every layer")
        p, names, inter = p + "mlp.", ("gate_proj", "up_proj", "down_proj"), cfg["moe_intermediate_size"]
    else:
        inter = cfg["intermediate_size"]
        return {p + "mlp.gate_proj.weight": normal(inter, hidden), p + "mlp.up_proj.weight": normal(inter, hidden),
                p + "mlp.down_proj.weight": normal(hidden, inter)}
    weights = {p + "gate.weight": normal(experts, hidden)}
    for e in range(experts):
        gate, up, down = (f"{p}experts.{e}.{name}.weight" for name in names)
        weights |= {gate: normal(inter, hidden), up: normal(inter, hidden), down: normal(hidden, inter)}
    return weights
