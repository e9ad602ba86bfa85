from __future__ import annotations

import math

import torch

from llmserve.common.basemodel import TransformerLayerWeight, WeightSpec


class BloomTransformerLayerWeight(TransformerLayerWeight):
    """BLOOM layer: LayerNorms with bias, a fused query_key_value stored head-interleaved
    ([heads, 3, head_dim, hidden]), a GELU MLP, and ALiBi instead of rotary."""

    def __init__(self, layer_num: int, tp_rank: int, world_size: int, data_type: torch.dtype, network_config, device: torch.device):
        super().__init__(layer_num, tp_rank, world_size, data_type, network_config, device)
        heads = network_config.num_attention_heads
        per_rank = heads // world_size
        self.tp_alibi = alibi_slopes(heads)[tp_rank * per_rank: (tp_rank + 1) * per_rank].to(device)

    def weight_specs(self) -> dict[str, WeightSpec]:
        p = f"h.{self.layer_num_}."
        return {
            "att_norm": WeightSpec(p + "input_layernorm.weight"),
            "att_norm_bias": WeightSpec(p + "input_layernorm.bias"),
            "qkv": WeightSpec(p + "self_attention.query_key_value.weight", self._split_fused_qkv),
            "qkv_bias": WeightSpec(p + "self_attention.query_key_value.bias", self._split_fused_qkv),
            "o": WeightSpec(p + "self_attention.dense.weight", "row"),
            "o_bias": WeightSpec(p + "self_attention.dense.bias"),
            "ffn_norm": WeightSpec(p + "post_attention_layernorm.weight"),
            "ffn_norm_bias": WeightSpec(p + "post_attention_layernorm.bias"),
            "ffn_1": WeightSpec(p + "mlp.dense_h_to_4h.weight", "col"),
            "ffn_1_bias": WeightSpec(p + "mlp.dense_h_to_4h.bias", "col"),
            "ffn_2": WeightSpec(p + "mlp.dense_4h_to_h.weight", "row"),
            "ffn_2_bias": WeightSpec(p + "mlp.dense_4h_to_h.bias"),
        }

    def _split_fused_qkv(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's heads, regrouped from per-head [q, k, v] into [all q; all k; all v] so the
        shared template can split the matmul output like Llama's."""
        heads = self.network_config_.num_attention_heads
        per_rank = heads // self.world_size_
        t = t.reshape(heads, 3, -1, *t.shape[1:])[self.tp_rank_ * per_rank: (self.tp_rank_ + 1) * per_rank]
        return t.transpose(0, 1).reshape(-1, *t.shape[3:])

    def _build(self, w: dict[str, torch.Tensor]) -> None:
        self.att_norm_weight_, self.att_norm_bias_ = w["att_norm"], w["att_norm_bias"]
        self.qkv_weight_, self.qkv_bias_ = w["qkv"], w["qkv_bias"]
        self.o_weight_, self.o_bias_ = w["o"], w["o_bias"]
        self.ffn_norm_weight_, self.ffn_norm_bias_ = w["ffn_norm"], w["ffn_norm_bias"]
        self.ffn_1_weight_, self.ffn_1_bias_ = w["ffn_1"], w["ffn_1_bias"]
        self.ffn_2_weight_, self.ffn_2_bias_ = w["ffn_2"], w["ffn_2_bias"]


def alibi_slopes(n_head: int) -> torch.Tensor:
    """Per-head ALiBi slopes (Press et al.): a geometric sequence for the largest power of two
    not above n_head, then every other slope of the next power of two for the rest."""

    def power_of_2_slopes(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_head))
    slopes = power_of_2_slopes(closest)
    if closest < n_head:
        slopes += power_of_2_slopes(2 * closest)[0::2][: n_head - closest]
    return torch.tensor(slopes, dtype=torch.float32)
