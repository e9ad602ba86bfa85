"""A config's attention shape and whether tensor and pipeline parallelism can split it. Plain attribute reads,
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


def verify_pp_split(num_layers: int, pp: int) -> None:
    """Pipeline parallelism gives every stage at least one whole layer."""
    if pp > num_layers:
        raise ValueError(f"pp={pp} stages need at least one layer each; the model has {num_layers}")


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The layers pipeline stage ``stage`` of ``pp`` holds: consecutive, as even as possible, the
    earlier stages taking one more where ``pp`` does not divide the layers. (Not the later: the
    last stage also runs the final norm and the lm_head, a vocab x hidden matmul often the size
    of one or two layers, and stage 0's embedding is a lookup.)"""
    size, extra = divmod(num_layers, pp)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (stage < extra))


def describe_stages(num_layers: int, pp: int) -> str:
    """Which layers each stage holds, for the start-up line: "layers 0-15 | 16-31"."""
    spans = [stage_layers(num_layers, pp, s) for s in range(pp)]
    return "layers " + " | ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in spans)
