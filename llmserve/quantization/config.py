"""Reading a model's quantization: its config.json's ``quantization_config`` (through the format's
own library where there is one: compressed-tensors' config classes) and ``--quantization``."""


from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llmserve.common.errors import ModelLoadError
from llmserve.quantization import QUANTIZATION_CHOICES
from llmserve.quantization.formats import Format, awq_format, block_fp8_format, fp8_format, gptq_format
from llmserve.kernels.fp8_linear import FP8, FP8_MAX, quantize_fp8_rows
from llmserve.quantization.weights import BlockFp8Weight, Fp8Weight, Int4Weight, PackedWeight, pack_int4

__all__ = ["Quantization", "PackedWeight", "quantization_for", "quantize_fp8", "quantize_fp8_blocks", "quantize_int4"]


@dataclass
class Quantization:
    """How a model's linear weights are stored: ``description`` for /info and the start-up line;
    ``checkpoint`` the format the checkpoint's tensors are in (None: dense tensors); ``on_load``
    quantize dense linear weights to FP8 at load (``--quantization fp8`` on a bf16 checkpoint)."""

    description: str
    checkpoint: Format | None = None
    on_load: bool = False

    def collect(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return tensors if self.checkpoint is None else self.checkpoint.collect(tensors)

    def finish(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.finish()

    def quantize(self, w: torch.Tensor) -> torch.Tensor | PackedWeight:
        """A dense linear weight as it runs: FP8 with per-channel scales when quantizing on load."""
        return quantize_fp8(w) if self.on_load else w


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per-channel FP8 (scale = row amax / 448), dynamic per-token activations: vLLM's
    ``--quantization fp8`` on an unquantized checkpoint."""
    q, scale = quantize_fp8_rows(w, None)
    return Fp8Weight(q, scale.view(-1))


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> BlockFp8Weight:
    """Block-wise FP8 by round-to-nearest (scale = tile amax / 448): the benchmarks' stand-in for a
    DeepSeek / Qwen3-FP8 checkpoint (its kernel, its bytes)."""
    n, k = w.shape
    bn, bk = block
    tiles = F.pad(w.float(), (0, -k % bk, 0, -n % bn)).view(-(-n // bn), bn, -(-k // bk), bk)
    scale = (tiles.abs().amax((1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(tiles.shape[0] * bn, -1)[:n, :k]
    return BlockFp8Weight(q.contiguous(), scale, block)


def quantize_int4(w: torch.Tensor, group: int = 128) -> Int4Weight:
    """Asymmetric 4-bit per group of ``group`` columns by round-to-nearest: the benchmarks' stand-in
    for an AWQ / GPTQ checkpoint (the same kernel and bytes; calibration changes the values only)."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    zero = (-lo / scale).round().clamp(0, 15)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).view(n, k)
    return Int4Weight(pack_int4(q), scale, zero.to(torch.uint8), group)


def quantization_for(hf_config: dict | None, flag: str | None) -> Quantization | None:
    """The quantization of a model whose config.json's ``quantization_config`` is ``hf_config``
    (None: none), run with ``--quantization flag`` (None: whatever the checkpoint says). A flag
    that names another format than the checkpoint's, or a format or variant we do not run, raises
    ``ModelLoadError``."""
    if flag is not None and flag not in QUANTIZATION_CHOICES:
        raise ModelLoadError(f"unknown quantization {flag!r}; choose one of {', '.join(QUANTIZATION_CHOICES)}")
    if not hf_config:
        if flag is None:
            return None
        if flag != "fp8":
            raise ModelLoadError(f"--quantization {flag} needs a {flag} checkpoint; this one has no quantization_config "
                                 "(only fp8 quantizes an unquantized checkpoint at load)")
        return Quantization("fp8 quantized at load: per-channel weights, dynamic per-token activations", on_load=True)
    method = str(hf_config.get("quant_method", "")).lower()
    if flag is not None and flag != method:
        raise ModelLoadError(f"--quantization {flag} does not match the checkpoint's quant_method {method!r}")
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _fp8, "awq": _awq, "gptq": _gptq}
    if method not in readers:
        raise ModelLoadError(f"unsupported quant_method {method!r} in quantization_config "
                             f"(supported: {', '.join(readers)})")
    return readers[method](hf_config)


def _refuse(method: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"unsupported {method} checkpoint: {what}")


def _compressed_tensors(cfg: dict) -> Quantization:
    from compressed_tensors.quantization import QuantizationConfig   # the format's own reader

    try:
        qc = QuantizationConfig.model_validate(cfg)
    except Exception as e:  # pydantic's ValidationError, or a value its validators reject
        raise _refuse("compressed-tensors", f"its quantization_config does not validate ({e})") from e
    schemes = list((qc.config_groups or {}).values())
    if not schemes and qc.kv_cache_scheme is not None:
        # llm-compressor's KV-cache-only recipe: dense weights, scales for --kv-cache-dtype fp8
        return Quantization("compressed-tensors: dense weights, float8 KV-cache scales")
    if len(schemes) != 1:
        raise _refuse("compressed-tensors", f"{len(schemes)} config groups (one FP8 scheme is supported)")
    w, a = schemes[0].weights, schemes[0].input_activations
    fmt = schemes[0].format or qc.format
    if w is None or w.type != "float" or w.num_bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse("compressed-tensors", f"weights {w and (w.type, w.num_bits)} in format {fmt!r} "
                      "(FP8 float-quantized is supported)")
    ignored = f"; unquantized: {', '.join(qc.ignore)}" if qc.ignore else ""
    if w.strategy == "block":
        block = tuple(w.block_structure or (128, 128))
        return Quantization(f"compressed-tensors fp8, {block[0]}x{block[1]} weight blocks, dynamic activations{ignored}",
                            block_fp8_format(block, "weight_scale"))
    if w.strategy not in ("tensor", "channel"):
        raise _refuse("compressed-tensors", f"FP8 weight strategy {w.strategy!r} (tensor, channel or block)")
    static = a is not None and not a.dynamic
    if static and a.strategy != "tensor":
        raise _refuse("compressed-tensors", f"static activation strategy {a.strategy!r} (tensor is supported)")
    acts = "static per-tensor activations" if static else "dynamic per-token activations"
    return Quantization(f"compressed-tensors fp8, per-{w.strategy} weights, {acts}{ignored}", fp8_format(static))


def _fp8(cfg: dict) -> Quantization:
    if cfg.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fp8", f"fmt {cfg['fmt']!r} (e4m3 is supported)")
    block = cfg.get("weight_block_size")
    static = cfg.get("activation_scheme", "dynamic") == "static"
    if block is not None:
        if static or len(block) != 2:
            raise _refuse("fp8", "block-wise weights with static activations" if static else f"weight_block_size {block}")
        return Quantization(f"fp8, {block[0]}x{block[1]} weight blocks, dynamic activations",
                            block_fp8_format((int(block[0]), int(block[1])), "weight_scale_inv"))
    acts = "static per-tensor" if static else "dynamic per-token"
    return Quantization(f"fp8, per-tensor weights, {acts} activations", fp8_format(static))


def _int4_group(method: str, cfg: dict) -> int:
    bits = cfg.get("bits", cfg.get("w_bit"))
    group = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
    if bits != 4:
        raise _refuse(method, f"{bits}-bit weights (4-bit is supported)")
    if group > 0 and group & (group - 1):
        raise _refuse(method, f"group_size {group} (a power of two, or -1)")
    return group


def _awq(cfg: dict) -> Quantization:
    group = _int4_group("awq", cfg)
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm" or not cfg.get("zero_point", True):
        raise _refuse("awq", f"version {version!r}, zero_point {cfg.get('zero_point')} (GEMM with zero points is supported)")
    return Quantization(f"awq 4-bit, group {group}", awq_format(group))


def _gptq(cfg: dict) -> Quantization:
    group = _int4_group("gptq", cfg)
    if cfg.get("desc_act"):
        raise _refuse("gptq", "desc_act true (act-order reorders the input columns; quantize with desc_act false)")
    v2 = str(cfg.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    return Quantization(f"gptq 4-bit, group {group}", gptq_format(group, zero_offset=0 if v2 else 1))
