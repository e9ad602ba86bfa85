from __future__ import annotations

from typing import Callable

import torch

from llmserve.common.basemodel import WeightSpec
from llmserve.common.basemodel.basemodel import head_dim, num_kv_heads
from llmserve.common.rotary_embedding import rotary_dim
from llmserve.models.llama.layer_weights.transformer_layer_weight import LlamaTransformerLayerWeight


class Phi3TransformerLayerWeight(LlamaTransformerLayerWeight):
    """Llama's layer, stored fused: ``qkv_proj`` is q, k, v concatenated on the output dimension
    and ``gate_up_proj`` is gate then up. Each part is cut out of the fused tensor and split like
    Llama's own q, k, v, gate, up (so every rank gets its q, k and v heads and its gate and up
    columns), then Llama's ``_build`` fuses them again, per rank.

    With partial rotary (Phi-4-mini), each q and k head's rows are reordered so that the rotary
    kernel's pairs ``(i, i + head_dim / 2)`` are HF's ``(i, i + rotary_dim / 2)``, the rest passing
    through (see ``RotaryEmbedding``); q and k get the same order, so q . k is unchanged."""

    def weight_specs(self) -> dict[str, WeightSpec]:
        cfg = self.network_config_
        d = head_dim(cfg)
        q_rows, kv_rows = cfg.num_attention_heads * d, num_kv_heads(cfg) * d
        qkv = f"model.layers.{self.layer_num_}.self_attn.qkv_proj.weight"
        gate_up = f"model.layers.{self.layer_num_}.mlp.gate_up_proj.weight"
        inter = cfg.intermediate_size
        return {
            **super().weight_specs(),
            "q": WeightSpec(qkv, self._part(0, q_rows, rotary=True)),
            "k": WeightSpec(qkv, self._part(q_rows, kv_rows, rotary=True)),
            "v": WeightSpec(qkv, self._part(q_rows + kv_rows, kv_rows)),
            "gate": WeightSpec(gate_up, self._part(0, inter)),
            "up": WeightSpec(gate_up, self._part(inter, inter)),
        }

    def _part(self, start: int, rows: int, rotary: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """Rows ``start : start + rows`` of a fused ``[out, in]`` tensor, this rank's share of them."""
        def cut(t: torch.Tensor) -> torch.Tensor:
            part = t.narrow(0, start, rows)
            if rotary:
                part = self._rotary_order(part)
            return self._shard(part, dim=0)
        return cut

    def _rotary_order(self, t: torch.Tensor) -> torch.Tensor:
        d, r = head_dim(self.network_config_), rotary_dim(self.network_config_)
        if r == d:
            return t
        half, rot_half = d // 2, r // 2
        pass_half = half - rot_half
        # new position -> old dimension: [rot first half, pass first half, rot second half, pass second half]
        order = torch.cat([torch.arange(rot_half), torch.arange(r, r + pass_half),
                           torch.arange(rot_half, r), torch.arange(r + pass_half, d)])
        return t.reshape(-1, d, *t.shape[1:])[:, order].reshape(t.shape)
