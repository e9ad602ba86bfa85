"""A model worker's LoRA weights: a device pool of ``max_loras`` adapter slots, sized at start-up,
and the per-forward view the layers add the adapters' products with (``LoraBatch``).

Per projection group and layer the pool holds A ``[slots, m * R, in]`` (the m projections of a
fused group stacked, so one shrink and one expand serve q, k and v; with the model's dense
weights, right below the base weight in one tensor, ``widen``), and per group B ``[slots, layers,
out, R]`` (their B stacked as the fused output's columns), R = ``max_lora_rank``, an adapter of a
lower rank padded with zeros. Putting an adapter in a slot (``load``) is one host-to-device copy
per layer's A and per B, from the adapter packed on the host in the pool's layout (``pack``: pinned
memory for a CUDA pool; the worker keeps its read adapters packed). The engine
core decides which adapter goes where (``llmserve.lora.manager``).

Tensor parallelism cuts an adapter as the weight it wraps: for a column-parallel projection (q,
k, v, gate, up) B's rows (A whole), for a row-parallel one (o, down) A's columns (B whole). The
row-parallel product of a rank is then a partial sum, added to the base projection's partial
output before its all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels.autotune import fastest, rows_bucket
from llmserve.kernels.backend import use_triton
from llmserve.kernels.gemv import gemv_triton, takes_gemv
from llmserve.kernels.lora import (DECODE_ROWS, RowLora, lora_add, lora_expand_triton, lora_expand_wide, lora_row,
                                   lora_shrink_triton)
from llmserve.kernels.quantized_linear import linear
from llmserve.lora.adapter import LoraAdapter, projection_shape

# The layer's projection groups, in the fused output's column order (the layer weights' fusing).
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
ROW_PARALLEL = {"o", "down"}


# The layer weights' attribute holding each group's fused weight (LlamaTransformerLayerWeight's).
WEIGHT_ATTRS = {"qkv": "qkv_weight_", "o": "o_weight_", "gate_up": "gate_up_weight_", "down": "down_weight_"}


@dataclass
class _GroupWeights:
    a: list[torch.Tensor]           # per layer [slots, m * R, in / (tp if row-parallel)] (`LoraPool.widen`)
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
                [torch.zeros(max_loras, len(modules) * max_rank, in_dim, dtype=dtype, device=device)
                 for _ in range(num_layers)],
                torch.zeros(max_loras, num_layers, sum(splits), max_rank, dtype=dtype, device=device), splits)
        # Base weights with every slot's A below them, by (layer, group): see `widen`.
        self.wide: dict[tuple[int, str], torch.Tensor] = {}
        self._index_layers()

    def _index_layers(self) -> None:
        # What a layer's kernels read, by the model's layer number: per group, A [slots, m * R, in]
        # and B [slots, out, R] (views, made once: a forward asks for them 4 times a layer).
        self.layers = {layer: {group: (w.a[i], w.b[:, i], w.splits) for group, w in self.groups.items()}
                       for i, layer in enumerate(self.model_layers)}

    def widen(self, layer_weights: list) -> None:
        """Put every slot's A of each projection group right below the base weight it wraps, in one
        tensor ``[N + slots * m * R, in]``, so that one GEMM over it gives a batch's base output and
        every slot's shrink of every token side by side (``LoraBatch.linear``'s wide route: the
        shrink's A rides on the base weight's read, with no launch of its own). ``layer_weights``:
        the layers' weight objects, in `model_layers` order; each group's attribute (`WEIGHT_ATTRS`)
        becomes the first N rows of the new tensor (the same values, contiguous), A the rest (what
        the pool held). Left as they are: weights that are not plain half/full-precision tensors
        of the pool's dtype (quantized), and at tp > 1 the row-parallel groups, whose outputs an
        all-reduce sums in place (it takes contiguous tensors only)."""
        for i, (layer, weights) in enumerate(zip(self.model_layers, layer_weights, strict=True)):
            for group, attr in WEIGHT_ATTRS.items():
                base = getattr(weights, attr, None)     # None: an MoE layer has experts instead
                a = self.groups[group].a[i]
                if (type(base) is not torch.Tensor or base.dim() != 2 or base.shape[1] != a.shape[2]
                        or base.dtype != self.dtype or base.device != a.device
                        or (self.world_size > 1 and group in ROW_PARALLEL)):
                    continue
                n = base.shape[0]
                wide = torch.empty(n + a.shape[0] * a.shape[1], a.shape[2], dtype=self.dtype, device=a.device)
                wide[:n].copy_(base)
                wide[n:].copy_(a.view(-1, a.shape[2]))
                setattr(weights, attr, wide[:n])
                self.groups[group].a[i] = wide[n:].view(a.shape)
                self.wide[(layer, group)] = wide
                del base, a
        self._index_layers()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()    # the base weights' old blocks: fit for no wider tensor

    def _local(self, n: int, split: bool) -> int:
        return n // self.world_size if split else n

    def _cut(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        size = t.shape[dim] // self.world_size
        return t.narrow(dim, self.tp_rank * size, size)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for g in self.groups.values() for t in (*g.a, g.b))

    def pack(self, adapter: LoraAdapter) -> PackedAdapter:
        """``adapter``'s share for this rank in the pool's layout, on the host (pinned for a CUDA
        pool, so that `load` copies it asynchronously at full speed)."""
        r, pin = adapter.rank, self.device.type == "cuda"
        tensors = {}
        for group, modules in GROUPS.items():
            weights = self.groups[group]
            layers, in_dim = len(weights.a), weights.a[0].shape[-1]
            # zeros where it wraps no projection, or past a module's rank below the adapter's (rank_pattern)
            a_host = torch.zeros(layers, len(modules), r, in_dim, dtype=self.dtype, pin_memory=pin)
            b_host = torch.zeros(layers, weights.b.shape[2], r, dtype=self.dtype, pin_memory=pin)
            for j, module in enumerate(modules):
                col, n = sum(weights.splits[:j]), weights.splits[j]     # its columns of the fused output
                for i, layer in enumerate(self.model_layers):
                    ab = adapter.weights.get((layer, module))
                    if ab is None:
                        continue
                    a, b = ab
                    if group in ROW_PARALLEL:
                        a = self._cut(a, 1)
                    else:
                        b = self._cut(b, 0)
                    a_host[i, j, : a.shape[0]].copy_(a)
                    b_host[i, col : col + n, : b.shape[1]].copy_(b)
            tensors[group] = (a_host, b_host)
        return PackedAdapter(adapter.name, r, adapter.scaling, tensors)

    def load(self, slot: int, adapter: PackedAdapter | LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` (whatever was there goes): one copy per pool tensor (after
        zeroing the slot where the adapter's rank is below the pool's; A one copy per layer, as each
        layer's A is a tensor of its own, `widen`). Asynchronous on a CUDA pool: the forwards after
        it run on the same stream."""
        if isinstance(adapter, LoraAdapter):
            adapter = self.pack(adapter)
        r = adapter.rank
        if not 1 <= r <= self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {r}, the pool's slots hold up to {self.max_rank}")
        for group, (a_host, b_host) in adapter.tensors.items():
            weights = self.groups[group]
            b = weights.b[slot]
            _, m, _, in_dim = a_host.shape
            if r < self.max_rank:     # the padding rows of A and columns of B are zero
                b.zero_()
            for i, a in enumerate(weights.a):
                a = a[slot].view(m, self.max_rank, in_dim)
                if r < self.max_rank:
                    a[:, r:].zero_()
                a[:, :r].copy_(a_host[i], non_blocking=True)
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
    rank: torch.Tensor | None = None   # [slots] each slot's rank: None, the pool's (a route's timing: its own)

    def __post_init__(self) -> None:
        if self.rank is None:
            self.rank = self.pool.rank

    @classmethod
    def of(cls, pool: LoraPool, b_lora_slot: list[int], b_q_len: list[int]) -> LoraBatch:
        """The batch of requests on slots ``b_lora_slot`` (-1: the base model) bringing ``b_q_len``
        tokens each: its tokens grouped by slot on the host (`lora_segments`), then one copy."""
        seg_start, rows, max_len = lora_segments(b_lora_slot, b_q_len, pool.max_loras)
        block = torch.tensor(seg_start + rows, dtype=torch.int32).to(pool.device, non_blocking=True)
        return cls(pool, block[: len(seg_start)], block[len(seg_start) :], max_len)

    def linear(self, layer_num: int, group: str, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight^T (+ bias)`` with each token's adapter's product for projection group
        ``group`` added: at one row a GEMV adds it in its epilogue after a one-row shrink (`row`);
        at more, one of two routes (`route`): the base GEMM over the weight widened by every
        slot's A (`LoraPool.widen`), then the expand from its tail; or the shrink on a side
        stream beside the base projection, then the expand."""
        if takes_gemv(x, weight):
            return gemv_triton(x, weight, bias, lora=self.row(layer_num, group, x))
        if self.route(layer_num, group, x, weight) == "wide":
            return self._wide(layer_num, group, x, weight, bias)
        return self._beside(layer_num, group, x, weight, bias)

    def route(self, layer_num: int, group: str, x: torch.Tensor, weight) -> str:
        """``"wide"`` where the group's weight is widened and, on a GPU, the widened GEMM with the
        expand beats the side stream's shrink beside the base GEMM for this shape and row bucket
        (timed once, on every slot full, as `kernels.autotune` times the linear layers: which wins
        depends on how cuBLAS takes the wider shape); else ``"beside"``."""
        wide = self.pool.wide.get((layer_num, group))
        if wide is None or wide.data_ptr() != weight.data_ptr():
            return "beside"
        if not x.is_cuda:
            return "wide"
        if x.shape[0] > DECODE_ROWS:
            # A prompt's rows, not timed at serving time (decode buckets are timed as their CUDA
            # graphs are captured; see kernels/autotune.py). Its GEMM is bound by arithmetic, and
            # the wide route shrinks every token by every slot's A: taken while those rows stay
            # a small share of the weight's (a sixteenth; 8 rank-16 slots on Llama-3-8B's qkv).
            return "wide" if wide.shape[0] - weight.shape[0] <= weight.shape[0] // 16 else "beside"
        key = ("lora_route", x.device, tuple(wide.shape), weight.shape[0], rows_bucket(x.shape[0]))
        timed: list[LoraBatch] = []     # made on the first timed call only (`fastest` runs none once it knows)

        def run(route: str) -> torch.Tensor:
            if not timed:
                timed.append(self._everyone_on_every_slot(x.shape[0]))
            return (timed[0]._wide if route == "wide" else timed[0]._beside)(layer_num, group, x, weight, None)

        return fastest(key, ("wide", "beside"), run)

    def _everyone_on_every_slot(self, n: int) -> LoraBatch:
        """A batch of n tokens spread over all slots, each slot at the pool's full rank (the routes'
        timing: the slots' real ranks may be zero at start-up)."""
        pool = self.pool
        full = LoraBatch.of(pool, [i % pool.max_loras for i in range(n)], [1] * n)
        full.rank = torch.full_like(pool.rank, pool.max_rank)
        return full

    def _wide(self, layer_num: int, group: str, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        """One GEMM over the widened weight: its first N columns are the base output (a view with
        the wider row stride), the rest every slot's shrink of every token, which the expand reads
        (`lora_expand_wide`)."""
        pool = self.pool
        _, b, splits = pool.layers[layer_num][group]
        out = linear(x, pool.wide[(layer_num, group)], None)
        y, s_all = out[:, : weight.shape[0]], out[:, weight.shape[0] :]
        if bias is not None:
            y += bias
        lora_expand_wide(y, s_all, b, pool.scaling, self.rank, self.seg_start, self.rows, self.max_len, splits,
                         pool.max_rank)
        return y

    def _beside(self, layer_num: int, group: str, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
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
        shrunk = lora_shrink_triton(x, a, self.rank, self.seg_start, self.rows, self.max_len, splits, pool.max_rank,
                                    stream=side)
        out = linear(x, weight, bias)
        main.wait_stream(side)
        if shrunk is not None:
            lora_expand_triton(out, shrunk, b, pool.scaling, self.rank, self.seg_start, self.rows, splits,
                               pool.max_rank)
        return out

    def row(self, layer_num: int, group: str, x: torch.Tensor) -> RowLora:
        """A one-row batch's shrink for ``group`` (Triton: the row's GEMV takes it, `takes_gemv`)."""
        pool = self.pool
        a, b, splits = pool.layers[layer_num][group]
        return lora_row(x, a, b, pool.scaling, self.rank, self.seg_start, splits, pool.max_rank)

    def add(self, layer_num: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out += `` each token's adapter's product for projection group ``group`` (``out`` is
        the group's fused output, ``x`` its input): a shrink and an expand (``lora_add``)."""
        pool = self.pool
        a, b, splits = pool.layers[layer_num][group]
        lora_add(out, x, a, b, pool.scaling, self.rank, self.seg_start, self.rows, self.max_len, splits, pool.max_rank)
