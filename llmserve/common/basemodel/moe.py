"""Mixture-of-experts MLP layers, for any family whose layers are a dense layer with the MLP
swapped for routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE).

A family says where a layer's experts are (``MoeLayout``, or None for a dense layer) by mixing
``MoeLayerWeight`` into its layer-weight class and ``MoeLayerInfer`` into its layer-infer class,
both ahead of the dense classes: the dense layer's own MLP serves the layers without experts.

Tensor parallelism cuts every expert as a dense MLP is cut: each rank holds all experts, with
its columns of each gate and up and its rows of each down, so a token's output on one rank is a
partial sum over its slice of the intermediate size, all-reduced once with the shared expert's
(Qwen2-MoE). The router is small and whole on every rank, so every rank routes alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.common.basemodel.layer_weights.base_layer_weight import Weight, WeightSpec
from llmserve.common.errors import ModelLoadError
from llmserve.kernels import linear, silu_and_mul_fwd
from llmserve.kernels.fused_moe import fused_moe
from llmserve.kernels.moe_route import select_experts
from llmserve.kernels.quantized_linear import QuantizedWeight, stack_rows


@dataclass(frozen=True)
class MoeLayout:
    """Where one layer's experts sit in a checkpoint, and how tokens are routed to them."""

    prefix: str                       # "model.layers.3.block_sparse_moe."
    num_experts: int
    top_k: int
    renormalize: bool                 # the k weights rescaled to sum to 1
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    shared_expert: bool = False       # Qwen2-MoE: a dense MLP beside the experts, under a sigmoid gate


@dataclass
class MoeWeights:
    """One rank's share of a MoE layer: the router ``[E, H]`` whole, each expert's gate and up
    rows stacked as ``w13`` ``[E, 2I, H]`` and its down as ``w2`` ``[E, H, I]`` (I this rank's)."""

    router: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    top_k: int
    renormalize: bool
    shared_gate_up: torch.Tensor | None = None  # [2Is, H], as a dense MLP's
    shared_down: torch.Tensor | None = None     # [H, Is]
    shared_gate: torch.Tensor | None = None     # [1, H]


def moe_weight_specs(layout: MoeLayout) -> dict[str, WeightSpec]:
    p, (gate, up, down) = layout.prefix, layout.expert_names
    specs = {"router": WeightSpec(p + "gate.weight")}
    for e in range(layout.num_experts):
        specs |= {
            f"expert.{e}.gate": WeightSpec(f"{p}experts.{e}.{gate}.weight", "col"),
            f"expert.{e}.up": WeightSpec(f"{p}experts.{e}.{up}.weight", "col"),
            f"expert.{e}.down": WeightSpec(f"{p}experts.{e}.{down}.weight", "row"),
        }
    if layout.shared_expert:
        specs |= {
            "shared.gate": WeightSpec(p + "shared_expert.gate_proj.weight", "col"),
            "shared.up": WeightSpec(p + "shared_expert.up_proj.weight", "col"),
            "shared.down": WeightSpec(p + "shared_expert.down_proj.weight", "row"),
            "shared.router": WeightSpec(p + "shared_expert_gate.weight"),
        }
    return specs


def build_moe_weights(layout: MoeLayout, w: dict[str, Weight]) -> MoeWeights:
    if any(isinstance(t, QuantizedWeight) for t in w.values()):
        raise ModelLoadError("quantized mixture-of-experts weights are not supported")
    experts = range(layout.num_experts)
    moe = MoeWeights(
        router=w["router"],
        w13=torch.stack([torch.cat([w[f"expert.{e}.gate"], w[f"expert.{e}.up"]]) for e in experts]),
        w2=torch.stack([w[f"expert.{e}.down"] for e in experts]),
        top_k=layout.top_k, renormalize=layout.renormalize,
    )
    if layout.shared_expert:
        moe.shared_gate_up = stack_rows([w["shared.gate"], w["shared.up"]])
        moe.shared_down = w["shared.down"]
        moe.shared_gate = w["shared.router"].reshape(1, -1)    # a GGUF file may store it as a vector
    return moe


def moe_forward(x: torch.Tensor, moe: MoeWeights) -> torch.Tensor:
    """This rank's share of the layer's MLP output for x ``[n, H]`` (its columns of every expert's
    gate / up and rows of its down): the caller sums it over the tensor-parallel ranks."""
    weights, ids = select_experts(linear(x, moe.router), moe.top_k, moe.renormalize)
    out = fused_moe(x, moe.w13, moe.w2, weights, ids)
    if moe.shared_gate_up is not None:
        shared = linear(silu_and_mul_fwd(linear(x, moe.shared_gate_up)), moe.shared_down)
        out = out + torch.sigmoid(linear(x, moe.shared_gate)) * shared  # the gate is whole: linear in the parts
    return out


class MoeLayerWeight:
    """Mixed in ahead of a dense layer-weight class whose ``ffn_specs`` / ``_build_ffn`` load its
    MLP: a layer with a ``moe_layout`` loads experts instead, into ``moe_`` (None on dense layers)."""

    def moe_layout(self) -> MoeLayout | None:
        raise NotImplementedError

    def ffn_specs(self) -> dict[str, WeightSpec]:
        layout = self.moe_layout()
        return super().ffn_specs() if layout is None else moe_weight_specs(layout)  # type: ignore[misc]

    def _build_ffn(self, w: dict[str, Weight]) -> None:
        layout = self.moe_layout()
        self.moe_: MoeWeights | None = None
        if layout is None:
            super()._build_ffn(w)  # type: ignore[misc]
        else:
            self.moe_ = build_moe_weights(layout, w)


class MoeLayerInfer:
    """Mixed in ahead of a dense layer-infer class: layers whose weights hold experts run them."""

    def _ffn(self, x: torch.Tensor, infer_state, layer_weight) -> torch.Tensor:
        if layer_weight.moe_ is None:
            return super()._ffn(x, infer_state, layer_weight)  # type: ignore[misc]
        return self._sum_over_ranks(moe_forward(x, layer_weight.moe_))  # type: ignore[attr-defined]
