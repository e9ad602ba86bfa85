"""A model worker's LoRA weights: a device pool of ``max_loras`` adapter slots, sized at start-up,
and the per-forward view the layers add the adapters' products with (``LoraBatch``).

Per layer and projection group the pool holds A ``[slots, m * R, in]`` (the m projections of a
fused group stacked, so one shrink serves q, k and v) and B ``[slots, out, R]`` (their B stacked
as the fused output's columns, so one expand serves them), R = ``max_lora_rank``, an adapter of a
lower rank padded with zeros. A slot is filled
by ``load`` (the engine core decides which adapter goes where: ``llmserve.lora.manager``).

Tensor parallelism cuts an adapter as the weight it wraps: for a column-parallel projection (q,
k, v, gate, up) B's rows (A whole), for a row-parallel one (o, down) A's columns (B whole). The
row-parallel product of a rank is then a partial sum, added to the base projection's partial
output before its all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels.lora import lora_expand, lora_shrink
from llmserve.lora.adapter import LoraAdapter, projection_shape

# The layer's projection groups, in the fused output's column order (the layer weights' fusing).
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
ROW_PARALLEL = {"o", "down"}


@dataclass
class _GroupWeights:
    a: torch.Tensor                 # [slots, m * R, in / (tp if row-parallel)]
    b: torch.Tensor                 # [slots, sum of the outs / (tp if column-parallel), R]
    splits: tuple[int, ...]         # each projection's output columns (on this rank), in order


class LoraPool:
    def __init__(self, network_config, max_loras: int, max_rank: int, tp_rank: int, world_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.tp_rank, self.world_size = tp_rank, world_size
        self.config = network_config
        self.device = device
        self.rank = torch.zeros(max_loras, dtype=torch.int32, device=device)        # 0: an empty slot
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.names: list[str | None] = [None] * max_loras
        self.layers: list[dict[str, _GroupWeights]] = []
        for _ in range(network_config.num_hidden_layers):
            groups = {}
            for group, modules in GROUPS.items():
                in_dim = self._local(projection_shape(network_config, modules[0])[0], group in ROW_PARALLEL)
                a = torch.zeros(max_loras, len(modules) * max_rank, in_dim, dtype=dtype, device=device)
                splits = tuple(self._local(projection_shape(network_config, m)[1], group not in ROW_PARALLEL)
                               for m in modules)
                b = torch.zeros(max_loras, sum(splits), max_rank, dtype=dtype, device=device)
                groups[group] = _GroupWeights(a, b, splits)
            self.layers.append(groups)

    def _local(self, n: int, split: bool) -> int:
        return n // self.world_size if split else n

    def _cut(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        size = t.shape[dim] // self.world_size
        return t.narrow(dim, self.tp_rank * size, size)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for g in layer.values() for t in (g.a, g.b))

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` (whatever was there goes): this rank's share of its A and B,
        zero where it wraps no projection or its rank is below the pool's."""
        r = adapter.rank
        for layer_num, groups in enumerate(self.layers):
            for group, modules in GROUPS.items():
                weights = groups[group]
                weights.a[slot].zero_()
                weights.b[slot].zero_()
                for j, module in enumerate(modules):
                    col, n = sum(weights.splits[:j]), weights.splits[j]     # its columns of the fused output
                    ab = adapter.weights.get((layer_num, module))
                    if ab is None:
                        continue
                    a, b = ab
                    if group in ROW_PARALLEL:
                        a = self._cut(a, 1)
                    else:
                        b = self._cut(b, 0)
                    weights.a[slot, j * self.max_rank : j * self.max_rank + r].copy_(a)
                    weights.b[slot, col : col + n, :r].copy_(b)
        self.rank[slot] = r
        self.scaling[slot] = adapter.scaling
        self.names[slot] = adapter.name


@dataclass
class LoraBatch:
    """The adapters of one forward's requests: request i's segment of new tokens (``b_start``,
    ``b_len``: the batch's packing) uses slot ``b_slot[i]`` of the pool (-1: the base model)."""

    pool: LoraPool
    b_slot: torch.Tensor        # [bs] int32 on the device
    b_start: torch.Tensor       # [bs] int32
    b_len: torch.Tensor         # [bs] int32
    max_len: int                # the longest segment (bounds the kernels' grid)

    def add(self, layer_num: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out += `` each request's adapter's product for projection group ``group`` (``out`` is
        the group's fused output, ``x`` its input): one shrink, one expand."""
        pool, weights = self.pool, self.pool.layers[layer_num][group]
        s = lora_shrink(x, weights.a, self.b_start, self.b_len, self.b_slot, pool.rank, self.max_len, pool.max_rank)
        lora_expand(out, s, weights.b, pool.scaling, self.b_start, self.b_len, self.b_slot, pool.rank, self.max_len,
                    weights.splits)
