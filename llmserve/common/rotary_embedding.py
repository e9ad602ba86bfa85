"""Rotary position embedding tables (cos/sin per position), for every rope type transformers knows.

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (llama3, linear,
dynamic NTK, yarn, longrope), so scaled variants match the reference implementation exactly;
the rotation itself is a kernel (the layers run ``rotary_emb_copy_kv``, which stores K and V too)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from llmserve.common.basemodel.basemodel import head_dim


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The config's rope parameters; those of one layer type (``"sliding_attention"``,
    ``"full_attention"``) where they differ by type (Gemma 3: its own base for local layers)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    return dict(params.get(layer_type) or {}) if layer_type is not None else params


def rope_type(config: PretrainedConfig, layer_type: str | None = None) -> str:
    """The config's rope type: default, llama3, linear, dynamic, yarn, longrope, ..."""
    return rope_parameters(config, layer_type).get("rope_type", "default")


def rotary_dim(config: PretrainedConfig, layer_type: str | None = None) -> int:
    """How many of a head's dimensions rotate (``partial_rotary_factor``: Phi-4-mini's 0.75)."""
    factor = rope_parameters(config, layer_type).get("partial_rotary_factor", 1.0)
    return int(head_dim(config) * factor)


class RotaryEmbedding:
    def __init__(self, config: PretrainedConfig, device: torch.device, max_position: int,
                 layer_type: str | None = None):
        self.config = config
        self.layer_type = layer_type   # the layers whose rope parameters these are (None: all)
        self.rope_type: str = rope_type(config, layer_type)
        self.head_dim: int = head_dim(config)
        self.rotary_dim: int = rotary_dim(config, layer_type)
        self.device = device
        inv_freq, self.attention_scaling = self._inv_freq(seq_len=None)
        # Dynamic NTK stretches the frequencies once a sequence outgrows the trained context, so
        # its table depends on the batch; every other type gets one table up front.
        self.original_max_position: int = config.max_position_embeddings
        self.is_dynamic = self.rope_type == "dynamic"
        self._original_inv_freq = inv_freq
        # LongRoPE has two sets of frequencies: a sequence no longer than the original context
        # uses the short factors, a longer one the long factors (as HF decides per forward, from
        # the sequence's length). The table holds both, short rows then long rows; cos_sin picks
        # a token's row by its sequence's length.
        self.long_after: int | None = None
        self._long_inv_freq: torch.Tensor | None = None
        if self.rope_type == "longrope":
            params = rope_parameters(config, layer_type)
            self.long_after = int(params.get("original_max_position_embeddings")
                                  or getattr(config, "original_max_position_embeddings", None)
                                  or config.max_position_embeddings)
            self._long_inv_freq, _ = self._inv_freq(seq_len=self.long_after + 1)
        self._cos, self._sin = self._tables(max_position)

    def _inv_freq(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        if self.rope_type == "default":
            theta = rope_parameters(self.config, self.layer_type)["rope_theta"]
            dim = self.rotary_dim
            return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        if self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope type {self.rope_type!r}")
        kw = {} if self.layer_type is None else {"layer_type": self.layer_type}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, torch.device("cpu"), seq_len=seq_len, **kw)
        return inv_freq.float(), float(scaling)

    def _table(self, inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(positions.float(), inv_freq)
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        if self.rotary_dim < self.head_dim:
            # Partial rotary: the dimensions past rotary_dim / 2 of each half pass through
            # (cos 1, sin 0, exact). A family using it orders each q/k head so that the kernel's
            # pairs (i, i + head_dim / 2) are HF's (i, i + rotary_dim / 2) (Phi-3's weights do).
            pad = self.head_dim // 2 - inv_freq.numel()
            cos = torch.cat([cos, cos.new_ones(cos.shape[0], pad)], dim=1)
            sin = torch.cat([sin, sin.new_zeros(sin.shape[0], pad)], dim=1)
        return cos.to(self.device), sin.to(self.device)

    def _tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(n)
        cos, sin = self._table(self._original_inv_freq, positions)
        if self._long_inv_freq is not None:
            long_cos, long_sin = self._table(self._long_inv_freq, positions)
            cos, sin = torch.cat([cos, long_cos]), torch.cat([sin, long_sin])
        return cos, sin

    @property
    def _rows(self) -> int:
        """Positions the table covers (each of LongRoPE's two halves)."""
        return self._cos.shape[0] // (2 if self._long_inv_freq is not None else 1)

    def cos_sin(self, position_ids: torch.Tensor, max_seq_len: int,
                token_seq_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[n, head_dim // 2]`` cos and sin for the given positions. ``token_seq_len``:
        each token's sequence length (cached + new), which picks LongRoPE's short or long
        frequencies; without it every token gets the short ones."""
        if self.is_dynamic and max_seq_len > self.original_max_position:
            inv_freq, _ = self._inv_freq(seq_len=max_seq_len)
            return self._table(inv_freq, position_ids.cpu())
        if max_seq_len > self._rows:
            self._cos, self._sin = self._tables(max(max_seq_len, 2 * self._rows))
        rows = position_ids
        if self.long_after is not None and token_seq_len is not None:
            rows = position_ids + (token_seq_len > self.long_after).long() * self._rows
        return self._cos[rows], self._sin[rows]
