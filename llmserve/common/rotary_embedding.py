"""Rotary position embedding tables (cos/sin per position), for every rope type transformers knows.

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (llama3, linear,
dynamic NTK, yarn, longrope), so scaled variants match the reference implementation exactly;
the rotation itself is a kernel (the layers run ``rotary_emb_copy_kv``, which stores K and V too)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from llmserve.common.basemodel.basemodel import head_dim


def rope_type(config: PretrainedConfig) -> str:
    """The config's rope type: default, llama3, linear, dynamic, yarn, longrope, ..."""
    return dict(getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")


class RotaryEmbedding:
    def __init__(self, config: PretrainedConfig, device: torch.device, max_position: int):
        self.config = config
        self.rope_type: str = rope_type(config)
        self.head_dim: int = head_dim(config)
        self.device = device
        inv_freq, self.attention_scaling = self._inv_freq(seq_len=None)
        # Dynamic NTK stretches the frequencies once a sequence outgrows the trained context, so
        # its table depends on the batch; every other type gets one table up front.
        self.original_max_position: int = config.max_position_embeddings
        self.is_dynamic = self.rope_type == "dynamic"
        self._original_inv_freq = inv_freq
        self._cos, self._sin = self._table(inv_freq, max_position)

    def _inv_freq(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        if self.rope_type == "default":
            theta = self.config.rope_parameters["rope_theta"]
            dim = self.head_dim
            return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        if self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope type {self.rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, torch.device("cpu"), seq_len=seq_len)
        return inv_freq.float(), float(scaling)

    def _table(self, inv_freq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(n, dtype=torch.float), inv_freq)
        return (freqs.cos() * self.attention_scaling).to(self.device), (freqs.sin() * self.attention_scaling).to(self.device)

    def cos_sin(self, position_ids: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[n, head_dim // 2]`` cos and sin for the given positions."""
        if self.is_dynamic and max_seq_len > self.original_max_position:
            inv_freq, _ = self._inv_freq(seq_len=max_seq_len)
            freqs = torch.outer(position_ids.float().cpu(), inv_freq)
            return (freqs.cos() * self.attention_scaling).to(self.device), (freqs.sin() * self.attention_scaling).to(self.device)
        if max_seq_len > self._cos.shape[0]:
            self._cos, self._sin = self._table(self._original_inv_freq, max(max_seq_len, 2 * self._cos.shape[0]))
        return self._cos[position_ids], self._sin[position_ids]
