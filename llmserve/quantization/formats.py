"""Checkpoint formats: which tensors of a quantized linear layer a format writes, and how they
become one of our weight classes (`weights.py`) in its canonical layout.

A layer is recognised by its tensors (``<module>.qweight``, a float8 ``<module>.weight``, ...), so
the layers a config leaves unquantized (``ignore``, ``modules_to_not_convert``) arrive as plain
``<module>.weight`` tensors and load as they are. A format's tensors may be spread over shard
files: `Format.collect` holds a layer's parts until all have arrived.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmserve.common.errors import ModelLoadError
from llmserve.quantization.weights import FP8, BlockFp8Weight, Fp8Weight, Int4Weight, PackedWeight, pack_int4

Parts = dict[str, torch.Tensor]


@dataclass
class Format:
    """One checkpoint format: ``parts`` the tensor suffixes of a quantized layer, of which
    ``required`` must all be there, and ``build`` the weight they make."""

    name: str
    parts: tuple[str, ...]
    required: tuple[str, ...]
    build: Callable[[Parts], PackedWeight]
    _pending: dict[str, Parts] = field(default_factory=dict)

    def _claims(self, suffix: str, t: torch.Tensor) -> bool:
        # A plain "weight" is a quantized layer's only if it is float8 (its siblings say so).
        return suffix in self.parts and (suffix != "weight" or t.dtype == FP8)

    def collect(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | PackedWeight]:
        """``tensors`` (one weight file) with each quantized layer's parts replaced by one
        ``<module>.weight`` entry holding its weight object; parts still missing wait for a later file."""
        out: dict[str, torch.Tensor | PackedWeight] = {}
        touched: set[str] = set()
        for name, t in tensors.items():
            module, _, suffix = name.rpartition(".")
            if self._claims(suffix, t):
                self._pending.setdefault(module, {})[suffix] = t
                touched.add(module)
            else:
                out[name] = t
        for module in touched:
            parts = self._pending[module]
            if all(p in parts for p in self.required):
                try:
                    out[f"{module}.weight"] = self.build(self._pending.pop(module))
                except (ValueError, RuntimeError) as e:
                    raise ModelLoadError(f"{self.name} layer {module}: {e}") from e
        return out

    def finish(self) -> None:
        """Raise if a layer's parts never all arrived."""
        if self._pending:
            module, parts = next(iter(self._pending.items()))
            missing = [p for p in self.required if p not in parts]
            raise ModelLoadError(f"{self.name} checkpoint: {module} lacks {', '.join(missing)} "
                                 f"({len(self._pending)} layer(s) incomplete)")


# -- FP8 with per-tensor or per-channel scales (compressed-tensors, vLLM's fp8) -------------------
def fp8_channel_weight(p: Parts, static_input: bool) -> Fp8Weight:
    w, s = p["weight"], p["weight_scale"].float()
    n = w.shape[0]
    if s.numel() not in (1, n):
        raise ValueError(f"weight_scale of {s.numel()} values for {n} output channels (expected 1 or {n})")
    input_scale = None
    if static_input:
        if "input_scale" not in p:
            raise ValueError("static activation scales, but no input_scale")
        input_scale = p["input_scale"].float().reshape(-1).amax().reshape(1)
    return Fp8Weight(w, s.reshape(-1).expand(n).contiguous(), input_scale)


def fp8_format(static_input: bool) -> Format:
    required = ("weight", "weight_scale") + (("input_scale",) if static_input else ())
    return Format("FP8", ("weight", "weight_scale", "input_scale"), required,
                  lambda p: fp8_channel_weight(p, static_input))


# -- block-wise FP8 (DeepSeek / Qwen3-FP8: weight_scale_inv; compressed-tensors "block": weight_scale)
def block_fp8_format(block: tuple[int, int], scale_name: str) -> Format:
    def build(p: Parts) -> BlockFp8Weight:
        w, s = p["weight"], p[scale_name].float()
        expect = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
        if tuple(s.shape) != expect:
            raise ValueError(f"{scale_name} of shape {tuple(s.shape)} for a {tuple(w.shape)} weight in "
                             f"{block[0]}x{block[1]} blocks (expected {expect})")
        return BlockFp8Weight(w, s, block)

    return Format("block-FP8", ("weight", scale_name), ("weight", scale_name), build)


# -- 4-bit AWQ (GEMM layout) and GPTQ --------------------------------------------------------
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
# AutoAWQ packs the 8 columns of a word in this order (nibble i holds column AWQ_ORDER[i]).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(8))


def unpack_int32(t: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (nibble 0 first) along ``dim``, 8x longer, uint8."""
    t = t.to(torch.int32).movedim(dim, -1)
    q = (t[..., None] >> _SHIFTS) & 15
    return q.reshape(*t.shape[:-1], -1).movedim(-1, dim).to(torch.uint8)


def _int4_weight(q_kn: torch.Tensor, zeros_gn: torch.Tensor, scales_gn: torch.Tensor, group: int) -> Int4Weight:
    """From the values ``[K, N]`` and per-group zeros and scales ``[K / group, N]`` (checkpoint order)."""
    k, n = q_kn.shape
    if k % group or scales_gn.shape != (k // group, n) or zeros_gn.shape != (k // group, n):
        raise ValueError(f"scales {tuple(scales_gn.shape)} / zeros {tuple(zeros_gn.shape)} do not fit a "
                         f"[{k}, {n}] weight in groups of {group}")
    return Int4Weight(pack_int4(q_kn.t()), scales_gn.t().float().contiguous(), zeros_gn.t().contiguous(), group)


def awq_format(group: int) -> Format:
    def build(p: Parts) -> Int4Weight:
        def columns(t: torch.Tensor) -> torch.Tensor:   # [rows, N / 8] words -> [rows, N] in column order
            q = unpack_int32(t, 1)
            return q.view(q.shape[0], -1, 8)[..., list(_AWQ_UNDO)].reshape(q.shape[0], -1)

        q = columns(p["qweight"])
        return _int4_weight(q, columns(p["qzeros"]), p["scales"], group if group > 0 else q.shape[0])

    return Format("AWQ", ("qweight", "qzeros", "scales"), ("qweight", "qzeros", "scales"), build)


def gptq_format(group: int, zero_offset: int) -> Format:
    """``zero_offset``: 1 for the original GPTQ format, which stores each zero point less one."""
    def build(p: Parts) -> Int4Weight:
        q = unpack_int32(p["qweight"], 0)                   # [K / 8, N] words packed along K
        k = q.shape[0]
        g = group if group > 0 else k
        if "g_idx" in p and not torch.equal(p["g_idx"].long().cpu(), torch.arange(k) // g):
            raise ValueError("its g_idx reorders the input columns (act-order / desc_act), which is not supported")
        zeros = (unpack_int32(p["qzeros"], 1) + zero_offset) & 15     # a stored 15 is a zero point of 0
        return _int4_weight(q, zeros, p["scales"], g)

    return Format("GPTQ", ("qweight", "qzeros", "scales", "g_idx"), ("qweight", "qzeros", "scales"), build)
