"""A config's attention shape and whether tensor parallelism can split it. Plain attribute reads,
no torch: the HTTP process checks a raw config with them before any worker loads the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def num_kv_heads(cfg: PretrainedConfig) -> int:
    """Key/value heads of the whole model (as many as attention heads without GQA)."""
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def head_dim(cfg: PretrainedConfig) -> int:
    """Size of one attention head (explicit in the config, or hidden_size split over the heads)."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def sliding_window(cfg: PretrainedConfig, layer: int) -> int:
    """The sliding window of layer ``layer`` (0: none; the query at p sees keys p - W < k <= p), as
    HF applies it: a config with ``layer_types`` slides the layers marked ``sliding_attention``
    (Gemma 2 / 3; Qwen2 / Qwen3 with ``use_sliding_window``, from ``max_window_layers`` on), one
    without slides every layer when it sets ``sliding_window`` (Mistral, Phi-3)."""
    window = getattr(cfg, "sliding_window", None) or 0
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return window if types[layer] == "sliding_attention" else 0
    return window


def verify_tp_split(cfg: PretrainedConfig, world_size: int) -> None:
    """Tensor parallelism gives every rank whole attention heads and whole KV heads."""
    for what, n in (("attention heads", cfg.num_attention_heads), ("key/value heads", num_kv_heads(cfg))):
        if n % world_size:
            raise ValueError(f"the model's {n} {what} are not divisible by tp={world_size}")
