"""A model worker's LoRA weights: a device pool of ``max_loras`` adapter slots, sized at start-up,
and the per-forward view the layers add the adapters' products with (``LoraBatch``).

Per projection group the pool holds A ``[slots, layers, m * R, in]`` (the m projections of a
fused group stacked, so one shrink and one expand serve q, k and v) and B ``[slots, layers, out, R]`` (their B
stacked as the fused output's columns), R = ``max_lora_rank``, an adapter of a lower rank padded
with zeros. A slot's share of a tensor is contiguous, so putting an adapter in a slot (``load``)
is one host-to-device copy per tensor, from the adapter packed on the host in the pool's layout
(``pack``: pinned memory for a CUDA pool; the worker keeps its read adapters packed). The engine
core decides which adapter goes where (``llmserve.lora.manager``).

Tensor parallelism cuts an adapter as the weight it wraps: for a column-parallel projection (q,
k, v, gate, up) B's rows (A whole), for a row-parallel one (o, down) A's columns (B whole). The
row-parallel product of a rank is then a partial sum, added to the base projection's partial
output before its all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels.backend import use_triton
from llmserve.kernels.gemv import gemv_triton, takes_gemv
from llmserve.kernels.lora import RowLora, lora_add, lora_expand_triton, lora_row, lora_shrink_triton
from llmserve.kernels.quantized_linear import linear
from llmserve.lora.adapter import LoraAdapter, projection_shape

# The layer's projection groups, in the fused output's column order (the layer weights' fusing).
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
ROW_PARALLEL = {"o", "down"}


@dataclass
class _GroupWeights:
    a: torch.Tensor                 # [slots, layers, m * R, in / (tp if row-parallel)]
    b: torch.Tensor                 # [slots, layers, sum of the outs / (tp if column-parallel), R]
    splits: tuple[int, ...]         # each projection's output columns (on this rank), in order


@dataclass
class PackedAdapter:
    """One adapter's share for one rank, on the host in the pool's layout and dtype at its own
    rank r: per group A ``[layers, m, r, in]`` and B ``[layers, out, r]`` (zero where it wraps no
    projection)."""

    name: str
    rank: int
    scaling: float
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoraPool:
    def __init__(self, network_config, max_loras: int, max_rank: int, tp_rank: int, world_size: int,
                 dtype: torch.dtype, device: torch.device, layers: range | None = None):
        """``layers``: the model's layers this rank runs (a pipeline stage's; None: all of them), the
        only ones whose adapter weights the pool holds."""
        self.max_loras, self.max_rank = max_loras, max_rank
        self.tp_rank, self.world_size = tp_rank, world_size
        self.config = network_config
        self.dtype, self.device = dtype, torch.device(device)
        self.rank = torch.zeros(max_loras, dtype=torch.int32, device=device)        # 0: an empty slot
        # Where a shrink runs beside its base projection (LoraBatch.linear); the worker's thread
        # that runs forwards is its only user.
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.names: list[str | None] = [None] * max_loras
        self.groups: dict[str, _GroupWeights] = {}
        self.model_layers = layers if layers is not None else range(network_config.num_hidden_layers)
        num_layers = len(self.model_layers)
        for group, modules in GROUPS.items():
            in_dim = self._local(projection_shape(network_config, modules[0])[0], group in ROW_PARALLEL)
            splits = tuple(self._local(projection_shape(network_config, m)[1], group not in ROW_PARALLEL)
                           for m in modules)
            self.groups[group] = _GroupWeights(
                torch.zeros(max_loras, num_layers, len(modules) * max_rank, in_dim, dtype=dtype, device=device),
                torch.zeros(max_loras, num_layers, sum(splits), max_rank, dtype=dtype, device=device), splits)
        # What a layer's kernels read, by the model's layer number: per group, A [slots, m * R, in]
        # and B [slots, out, R] (views, made once: a forward asks for them 4 times a layer).
        self.layers = {layer: {group: (w.a[:, i], w.b[:, i], w.splits) for group, w in self.groups.items()}
                       for i, layer in enumerate(self.model_layers)}

    def _local(self, n: int, split: bool) -> int:
        return n // self.world_size if split else n

    def _cut(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        size = t.shape[dim] // self.world_size
        return t.narrow(dim, self.tp_rank * size, size)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for g in self.groups.values() for t in (g.a, g.b))

    def pack(self, adapter: LoraAdapter) -> PackedAdapter:
        """``adapter``'s share for this rank in the pool's layout, on the host (pinned for a CUDA
        pool, so that `load` copies it asynchronously at full speed)."""
        r, pin = adapter.rank, self.device.type == "cuda"
        tensors = {}
        for group, modules in GROUPS.items():
            weights = self.groups[group]
            _, layers, _, in_dim = weights.a.shape
            a_host = torch.empty(layers, len(modules), r, in_dim, dtype=self.dtype, pin_memory=pin)
            b_host = torch.empty(layers, weights.b.shape[2], r, dtype=self.dtype, pin_memory=pin)
            for j, module in enumerate(modules):
                col, n = sum(weights.splits[:j]), weights.splits[j]     # its columns of the fused output
                for i, layer in enumerate(self.model_layers):
                    ab = adapter.weights.get((layer, module))
                    if ab is None:
                        a_host[i, j].zero_()
                        b_host[i, col : col + n].zero_()
                        continue
                    a, b = ab
                    if group in ROW_PARALLEL:
                        a = self._cut(a, 1)
                    else:
                        b = self._cut(b, 0)
                    a_host[i, j].copy_(a)
                    b_host[i, col : col + n].copy_(b)
            tensors[group] = (a_host, b_host)
        return PackedAdapter(adapter.name, r, adapter.scaling, tensors)

    def load(self, slot: int, adapter: PackedAdapter | LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` (whatever was there goes): one copy per pool tensor (after
        zeroing the slot where the adapter's rank is below the pool's). Asynchronous on a CUDA pool:
        the forwards after it run on the same stream."""
        if isinstance(adapter, LoraAdapter):
            adapter = self.pack(adapter)
        r = adapter.rank
        if not 1 <= r <= self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {r}, the pool's slots hold up to {self.max_rank}")
        for group, (a_host, b_host) in adapter.tensors.items():
            weights = self.groups[group]
            a, b = weights.a[slot], weights.b[slot]
            layers, m, _, in_dim = a_host.shape
            if r < self.max_rank:     # the padding rows of A and columns of B are zero
                a.zero_()
                b.zero_()
            a.view(layers, m, self.max_rank, in_dim)[:, :, :r].copy_(a_host, non_blocking=True)
            b[:, :, :r].copy_(b_host, non_blocking=True)
        self.rank[slot] = r
        self.scaling[slot] = adapter.scaling
        self.names[slot] = adapter.name


def lora_segments(b_slot: list[int], b_q_len: list[int], num_slots: int) -> tuple[list[int], list[int], int]:
    """A batch's token rows grouped by adapter slot, as the LoRA kernel reads them: ``seg_start``
    (``num_slots + 1`` offsets into ``rows``), ``rows`` (slot s's token rows, in order, at
    ``rows[seg_start[s] : seg_start[s + 1]]``; the base model's, slot -1, in none) and the longest
    segment. Request i's tokens are the batch's next ``b_q_len[i]`` rows."""
    by_slot: list[list[int]] = [[] for _ in range(num_slots)]
    start = 0
    for slot, n in zip(b_slot, b_q_len):
        if slot >= 0:
            by_slot[slot].extend(range(start, start + n))
        start += n
    seg_start, rows = [0], []
    for slot_rows in by_slot:
        rows += slot_rows
        seg_start.append(len(rows))
    return seg_start, rows, max(map(len, by_slot), default=0)


@dataclass
class LoraBatch:
    """The adapters of one forward's tokens: slot s's are rows ``rows[seg_start[s] :
    seg_start[s + 1]]`` of the batch (``lora_segments``), at most ``max_len`` of them (bounds the
    kernel's grid); rows in no segment are the base model's."""

    pool: LoraPool
    seg_start: torch.Tensor     # [slots + 1] int32 on the device
    rows: torch.Tensor          # int32
    max_len: int

    def linear(self, layer_num: int, group: str, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight^T (+ bias)`` with each token's adapter's product for projection group
        ``group`` added: at one row a GEMV adds it in its epilogue after a one-row shrink (`row`),
        at more `linear` beside the shrink, then the expand (`add`'s halves)."""
        if takes_gemv(x, weight):
            return gemv_triton(x, weight, bias, lora=self.row(layer_num, group, x))
        pool = self.pool
        side = pool.side_stream
        if side is None or not use_triton(x):
            out = linear(x, weight, bias)
            self.add(layer_num, group, x, out)
            return out
        # The shrink reads x only, so it runs on a side stream beside the base projection (at a
        # decode batch a GEMM of few tiles, which leaves SMs to it); the expand waits for both.
        # A CUDA graph captures the fork and the join as they are.
        a, b, splits = pool.layers[layer_num][group]
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        shrunk = lora_shrink_triton(x, a, pool.rank, self.seg_start, self.rows, self.max_len, splits, pool.max_rank,
                                    stream=side)
        out = linear(x, weight, bias)
        main.wait_stream(side)
        if shrunk is not None:
            lora_expand_triton(out, shrunk, b, pool.scaling, pool.rank, self.seg_start, self.rows, splits, pool.max_rank)
        return out

    def row(self, layer_num: int, group: str, x: torch.Tensor) -> RowLora:
        """A one-row batch's shrink for ``group`` (Triton: the row's GEMV takes it, `takes_gemv`)."""
        pool = self.pool
        a, b, splits = pool.layers[layer_num][group]
        return lora_row(x, a, b, pool.scaling, pool.rank, self.seg_start, splits, pool.max_rank)

    def add(self, layer_num: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out += `` each token's adapter's product for projection group ``group`` (``out`` is
        the group's fused output, ``x`` its input): a shrink and an expand (``lora_add``)."""
        pool = self.pool
        a, b, splits = pool.layers[layer_num][group]
        lora_add(out, x, a, b, pool.scaling, pool.rank, self.seg_start, self.rows, self.max_len, splits, pool.max_rank)
