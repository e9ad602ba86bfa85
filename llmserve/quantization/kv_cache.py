"""The KV cache's dtype (``--kv-cache-dtype``, vLLM's flag) and a float8 cache's scales.

``fp8`` (``fp8_e4m3``) stores K and V as float8 e4m3, each layer's K and V with one scale (the
stored value times the scale is the real one): half a bf16 cache's bytes, so twice its tokens in
the same memory. The scales are the checkpoint's where it has them (a compressed-tensors or FP8
checkpoint with a ``kv_cache_scheme``: ``self_attn.k_scale`` / ``v_scale``, or the older
``k_proj.output_scale`` / ``v_proj.output_scale``), else 1.0, as vLLM does without calibrated
scales. The store kernels quantize (`kernels.destindex_copy_kv`), attention dequantizes in registers.
"""

from __future__ import annotations

import logging
import re

import torch

from llmserve.common.errors import ModelLoadError
from llmserve.quantization import KV_CACHE_DTYPES

logger = logging.getLogger(__name__)

KV_FP8 = torch.float8_e4m3fn

# <prefix>layers.<i>.self_attn.{k_scale, v_scale, k_proj.output_scale, v_proj.output_scale, kv_scale}
_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale|(kv)_scale)$")


def kv_cache_dtype(flag: str, device: torch.device) -> torch.dtype | None:
    """The KV pool's dtype for ``--kv-cache-dtype flag``: None for auto (the model's), or float8;
    ``ModelLoadError`` for a value or a device that cannot run it."""
    if flag not in KV_CACHE_DTYPES:
        raise ModelLoadError(f"unknown --kv-cache-dtype {flag!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    if flag == "auto":
        return None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ModelLoadError(f"--kv-cache-dtype {flag} needs a GPU with float8 conversions (compute capability 8.9: "
                             f"Ada, Hopper or newer); this one is {major}.{minor}")
    return KV_FP8


def check_kv_cache_scheme(quantization_config: dict | None) -> None:
    """Refuse a checkpoint whose KV-cache scales are for something else than per-tensor float8."""
    scheme = (quantization_config or {}).get("kv_cache_scheme")
    if not scheme:
        return
    kind = (scheme.get("type", "float"), scheme.get("num_bits", 8), scheme.get("strategy", "tensor"))
    if kind != ("float", 8, "tensor"):
        raise ModelLoadError(f"the checkpoint's kv_cache_scheme is {kind[0]} {kind[1]}-bit per {kind[2]}; "
                             "--kv-cache-dtype fp8 reads per-tensor float8 scales only")


class KVCacheScales:
    """Each layer's (K, V) scales of a float8 cache, read from the checkpoint's tensors as they
    pass (`take`); 1.0 where it has none."""

    def __init__(self, num_layers: int) -> None:
        self.scales: list[list[float]] = [[1.0, 1.0] for _ in range(num_layers)]
        self.found = 0

    def take(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` without the KV-cache scales, which are kept. A scale per head (some tools
        write one) becomes their largest: the cache has one a tensor, and the largest clips none."""
        out = {}
        for name, t in tensors.items():
            m = _SCALE.search(name)
            if m is None:
                out[name] = t
                continue
            layer, which = int(m.group(1)), m.group(2) or m.group(3) or m.group(4)
            value = float(t.float().amax())
            if not value > 0:
                raise ModelLoadError(f"KV-cache scale {name} is {value}; scales must be positive")
            if layer < len(self.scales):
                for i in {"k": (0,), "v": (1,), "kv": (0, 1)}[which]:
                    self.scales[layer][i] = value
                self.found += 1
        return out

    def pairs(self) -> list[tuple[float, float]]:
        return [(k, v) for k, v in self.scales]

    def describe(self) -> str:
        return "the checkpoint's scales" if self.found else "scales 1.0: the checkpoint has none"
