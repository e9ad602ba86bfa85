"""Linear weights kept quantized: one class per storage format, each holding its packed values and
scales, cutting itself for tensor parallelism (`narrow`), stacking with its siblings (`cat`: fused
q/k/v, gate/up) and multiplying (`apply`, which `kernels.linear` calls for any weight that is not a
plain tensor).

Every format is stored in one canonical layout whatever checkpoint it came from (see
`llmserve.quantization.formats`), so each has one kernel:

- `Fp8Weight`: float8_e4m3 ``[N, K]`` with one float32 scale an output channel (a per-tensor
  scale is broadcast to every channel), and optionally a static per-tensor activation scale;
  without one, activations are quantized per token at run time. W8A8 (`kernels.fp8_linear`).
- `BlockFp8Weight`: float8_e4m3 ``[N, K]`` with a float32 scale per ``block`` (128 x 128) tile;
  the weight is dequantized inside the GEMM and multiplied in the activations' dtype (W8A16,
  `kernels.dequant_linear`).
- `Int4Weight`: 4-bit unsigned values ``[N, K / 2]`` uint8 (byte j of a row holds column 2j in its
  low nibble and 2j + 1 in its high one), a scale and an integer zero point per ``group`` columns of
  a row; value = (q - zero) * scale (AWQ, GPTQ; W4A16, `kernels.dequant_linear`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

import torch

from llmserve.common.errors import ModelLoadError
from llmserve.kernels.autotune import ROW_BUCKETS
from llmserve.kernels.backend import use_triton
from llmserve.kernels.dequant_linear import dequant_gemv_act_and_mul, dequant_linear, dequantize_blocks
from llmserve.kernels.fp8_linear import fp8_linear
from llmserve.kernels.gemv import ACTIVATIONS

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max          # 448


class PackedWeight:
    """What the loader and `linear` need of a quantized linear weight ``[N, K]`` (``N`` outputs)."""

    @property
    def shape(self) -> torch.Size:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self._tensors()[0].device

    @property
    def nbytes(self) -> int:
        """Bytes of the weight and its scales (what a step reads)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @property
    def format(self) -> str:
        raise NotImplementedError

    def _tensors(self) -> list[torch.Tensor]:
        return [v for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)]

    def _map(self, fn) -> PackedWeight:
        return replace(self, **{f.name: fn(v) for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)})

    def to(self, device: torch.device, dtype: torch.dtype) -> PackedWeight:
        """On ``device``, contiguous, to run with activations of ``dtype`` (scales stay float32)."""
        return self._map(lambda t: t.to(device).contiguous())

    def narrow(self, dim: int, start: int, length: int) -> PackedWeight:
        raise NotImplementedError

    @classmethod
    def cat(cls, weights: list[PackedWeight]) -> PackedWeight:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ self.T``, ``x`` of any leading dims, in x's dtype."""
        raise NotImplementedError

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """``act(gate) * up`` of ``x @ self.T`` for a gated MLP's fused gate_up weight (gate's
        rows, then up's), act a key of `gemv.ACTIVATIONS`. One row on the Triton backend is one
        launch (`dequant_gemv_act_and_mul`: the GEMV `apply` runs there, with the activation);
        anything else is `apply` and the activation's kernel."""
        if x.numel() == x.shape[-1] and x.stride(-1) == 1 and use_triton(x):
            return dequant_gemv_act_and_mul(x, *self._gemv_operands(), act)
        return ACTIVATIONS[act](self.apply(x))

    def _gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, int]]:
        """(values, scales, zero points, block) as `dequant_linear` takes them: what `apply` runs
        at one row on the Triton backend."""
        raise NotImplementedError


def _aligned(what: str, start: int, length: int, unit: int) -> None:
    if start % unit or length % unit:
        raise ModelLoadError(f"a {what} weight can only be cut on multiples of {unit} (its scale blocks): "
                             f"rows/columns {start}..{start + length}; choose another tensor-parallel size")


@dataclass(frozen=True)
class Fp8Weight(PackedWeight):
    weight: torch.Tensor                    # float8_e4m3 [N, K]
    weight_scale: torch.Tensor              # float32 [N]
    input_scale: torch.Tensor | None = None  # float32 [1]: static activations; None: per token

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def format(self) -> str:
        return "fp8" + ("" if self.input_scale is None else "-static")

    def narrow(self, dim: int, start: int, length: int) -> Fp8Weight:
        if dim == 0:
            return replace(self, weight=self.weight.narrow(0, start, length),
                           weight_scale=self.weight_scale.narrow(0, start, length))
        return replace(self, weight=self.weight.narrow(1, start, length))

    @classmethod
    def cat(cls, weights: list[Fp8Weight]) -> Fp8Weight:
        statics = [w.input_scale for w in weights if w.input_scale is not None]
        if statics and len(statics) != len(weights):
            raise ModelLoadError("cannot fuse FP8 layers with static and dynamic activation scales")
        # One activation quantization for the fused matmul: the largest scale clips none of them.
        input_scale = torch.stack(statics).amax(0) if statics else None
        return cls(torch.cat([w.weight for w in weights]), torch.cat([w.weight_scale for w in weights]), input_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.weight_scale[:, None], None, (1, self.shape[1]), dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale)

    def _gemv_operands(self):
        # One row runs W8A16 (fp8_linear's module doc): the scale a row, one block as wide as K.
        return self.weight, self.weight_scale.view(-1, 1), None, (1, self.shape[1])


@dataclass(frozen=True)
class BlockFp8Weight(PackedWeight):
    weight: torch.Tensor          # float8_e4m3 [N, K]
    scale: torch.Tensor           # float32 [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int] = (128, 128)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def format(self) -> str:
        return f"fp8-block{self.block[0]}x{self.block[1]}"

    def narrow(self, dim: int, start: int, length: int) -> BlockFp8Weight:
        b = self.block[dim]
        if length != self.weight.shape[dim]:
            _aligned("block-FP8", start, length, b)
        return replace(self, weight=self.weight.narrow(dim, start, length),
                       scale=self.scale.narrow(dim, start // b, -(-length // b)))

    @classmethod
    def cat(cls, weights: list[BlockFp8Weight]) -> BlockFp8Weight:
        if any(w.shape[0] % w.block[0] for w in weights[:-1]):
            # A block would hold rows of two weights: give every row its own scales instead.
            weights = [w.per_row() for w in weights]
        return cls(torch.cat([w.weight for w in weights]), torch.cat([w.scale for w in weights]), weights[0].block)

    def per_row(self) -> BlockFp8Weight:
        """The same values with a scale per row and ``block[1]`` columns."""
        scale = self.scale.repeat_interleave(self.block[0], 0)[: self.shape[0]]
        return replace(self, scale=scale.contiguous(), block=(1, self.block[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.scale, None, self.block, dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return dequant_linear(x, self.weight, self.scale, None, self.block)

    def _gemv_operands(self):
        return self.weight, self.scale, None, self.block


@dataclass(frozen=True)
class Int4Weight(PackedWeight):
    qweight: torch.Tensor         # uint8 [N, K / 2]
    scales: torch.Tensor          # [N, K / group], float32 until `to` (then the activations' dtype)
    zeros: torch.Tensor           # uint8 [N, K / group]
    group: int = 128

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qweight.shape[0], self.qweight.shape[1] * 2))

    @property
    def format(self) -> str:
        return f"int4-g{self.group}"

    def to(self, device: torch.device, dtype: torch.dtype) -> Int4Weight:
        # Scales in the activations' dtype, as the checkpoints store them (fp16): a quarter of
        # the 4-bit weight's bytes in float32 would be an eighth in half precision.
        return replace(self, qweight=self.qweight.to(device).contiguous(), zeros=self.zeros.to(device).contiguous(),
                       scales=self.scales.to(device, dtype if dtype.is_floating_point else torch.float32).contiguous())

    def narrow(self, dim: int, start: int, length: int) -> Int4Weight:
        if dim == 0:
            return self._map(lambda t: t.narrow(0, start, length))
        _aligned("4-bit", start, length, self.group)
        g0, ng = start // self.group, length // self.group
        return replace(self, qweight=self.qweight.narrow(1, start // 2, length // 2),
                       scales=self.scales.narrow(1, g0, ng), zeros=self.zeros.narrow(1, g0, ng))

    @classmethod
    def cat(cls, weights: list[Int4Weight]) -> Int4Weight:
        return cls(*(torch.cat([getattr(w, f) for w in weights]) for f in ("qweight", "scales", "zeros")), weights[0].group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self.qweight, self.scales, self.zeros, (1, self.group), dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return dequant_linear(x, self.qweight, self.scales, self.zeros, (1, self.group))

    def _gemv_operands(self):
        return self.qweight, self.scales, self.zeros, (1, self.group)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K / 2]`` from 4-bit values ``[N, K]`` (column 2j low nibble, 2j + 1 high)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def warm_up(weights: Iterable[object], dtype: torch.dtype, gate_ups: Iterable[tuple[object, str]] = ()) -> int:
    """Run each distinct quantized weight among ``weights`` (anything else is skipped) at one row
    and at every row bucket, and each distinct one of ``gate_ups`` (a gated MLP's fused weight and
    its activation) through `PackedWeight.act_and_mul` at one row, so that their kernels compile
    and autotune (`kernels/autotune.py`) at start-up rather than inside a served step; returns how
    many distinct weights of ``weights`` ran."""
    seen = set()
    for w in weights:
        if not isinstance(w, PackedWeight) or (key := (type(w), w.format, tuple(w.shape))) in seen:
            continue
        seen.add(key)
        for rows in (1, *ROW_BUCKETS):
            w.apply(torch.zeros(rows, w.shape[1], dtype=dtype, device=w.device))
    fused = set()
    for w, act in gate_ups:
        if isinstance(w, PackedWeight) and (key := (type(w), w.format, tuple(w.shape), act)) not in fused:
            fused.add(key)
            w.act_and_mul(torch.zeros(1, w.shape[1], dtype=dtype, device=w.device), act)
    return len(seen)
