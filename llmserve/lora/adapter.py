"""Reading a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
into per-layer A / B matrices, checked against the base model it is to run on.

The config is read by PEFT itself (``LoraConfig.from_pretrained``); the weights are PEFT's names,
``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]). What a layer adds is PEFT's ``lora_B(lora_A(x)) * scaling``, with scaling
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA.
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.common.errors import ModelLoadError

# The projections an adapter may wrap, by PEFT's module name -> ours (the layer's fused groups
# are made of them: q, k, v -> qkv; gate, up -> gate_up; o and down alone).
TARGET_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                  "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
# Fused projections, as HF's Phi-3 names its modules (the only ones a PEFT adapter of it can
# wrap): one lora_A for all parts, and lora_B's rows the parts' outputs in order (q, k, v; gate,
# up). Part p then adds x A^T B_p^T * scaling, exactly an adapter on the parts with A shared.
FUSED_MODULES = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
# A decoder layer's projection: ``model.layers.N`` (a causal LM), or a LLaVA's language model
# (``model.language_model.layers.N``, or ``language_model.model.layers.N`` before transformers 4.52).
_KEY = re.compile(r"^base_model\.model\.(?:model\.(?:language_model\.)?|language_model\.model\.)layers\.(\d+)\."
                  r"(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterLoadError(ModelLoadError):
    """An adapter directory that cannot be served; the message says why, in one line."""


@dataclass
class LoraAdapter:
    """One adapter's weights on the host, full size (each rank cuts its share when it loads
    them into its pool): ``weights[(layer, module)] = (A [r, in], B [out, r])``."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}


def read_adapter(name: str, path: str, network_config, max_rank: int) -> LoraAdapter:
    """The adapter at local directory ``path``, checked against the base model's config:
    ``AdapterLoadError`` if it wraps modules we cannot, has a rank above ``max_rank``, or shapes
    that do not fit the model."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise AdapterLoadError(f"LoRA adapter {name!r}: {path!r} is not a directory")
    try:
        config = LoraConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001  (PEFT raises ValueError, OSError, TypeError for bad files)
        raise AdapterLoadError(f"LoRA adapter {name!r}: cannot read {path}/adapter_config.json ({e})") from e
    _check_config(name, config, max_rank)
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        raise AdapterLoadError(f"LoRA adapter {name!r}: {path} has no adapter_model.safetensors")
    tensors = load_file(weights_file)
    # (layer, PEFT's module name, the module's path: model.layers.N.self_attn.q_proj) -> A and B
    halves: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or (m.group(3) not in TARGET_MODULES and m.group(3) not in FUSED_MODULES):
            raise AdapterLoadError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (only the decoder layers' "
                                   f"q/k/v/o/gate/up/down projections' (or qkv_proj's, gate_up_proj's) lora_A / "
                                   f"lora_B are served)")
        module_path = key[len("base_model.model.") : m.start(4) - len(".lora_")]
        halves.setdefault((int(m.group(1)), m.group(3), module_path), {})[m.group(4)] = t
    scaling = _scaling(config, config.r, config.lora_alpha)
    weights = {}
    rank = 0
    for (layer, peft_module, module_path), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterLoadError(f"LoRA adapter {name!r}: layer {layer} {peft_module} has lora_A or lora_B only")
        a, b = ab["A"], ab["B"]
        r, alpha = _module_rank_and_alpha(config, module_path)
        if r > max_rank:
            raise AdapterLoadError(f"LoRA adapter {name!r}: {module_path} has rank {r}, above --max-lora-rank {max_rank}")
        parts = FUSED_MODULES.get(peft_module, (TARGET_MODULES.get(peft_module),))
        _check_shapes(name, layer, peft_module, parts, a, b, r, network_config)
        module_scaling = _scaling(config, r, alpha)
        if module_scaling != scaling:
            # The pool keeps one scaling a slot: a module of another rank or alpha carries the ratio in B.
            b = b * (module_scaling / scaling)
        rank = max(rank, r)
        row = 0
        for part in parts:
            if (layer, part) in weights:
                raise AdapterLoadError(f"LoRA adapter {name!r}: layer {layer} wraps {part}_proj twice "
                                       f"(on its own and in a fused module)")
            rows = projection_shape(network_config, part)[1]
            weights[(layer, part)] = (a, b[row : row + rows])
            row += rows
    if not weights:
        raise AdapterLoadError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    return LoraAdapter(name, path, rank, scaling, weights)


def _module_rank_and_alpha(config, module_path: str) -> tuple[int, float]:
    """The rank and alpha PEFT gives the module at ``module_path`` (``model.layers.3.mlp.down_proj``):
    ``rank_pattern`` / ``alpha_pattern``'s entry whose key matches the path's end, else ``r`` /
    ``lora_alpha`` (PEFT's own matching, ``get_pattern_key``)."""
    from peft.utils.other import get_pattern_key

    r, alpha = config.r, config.lora_alpha
    if config.rank_pattern:
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module_path), r)
    if config.alpha_pattern:
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module_path), alpha)
    return r, alpha


def _scaling(config, r: int, alpha: float) -> float:
    """PEFT's ``lora_B(lora_A(x)) * scaling``: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / (math.sqrt(r) if config.use_rslora else r)


def _check_config(name: str, config, max_rank: int) -> None:
    def refuse(why: str) -> AdapterLoadError:
        return AdapterLoadError(f"LoRA adapter {name!r}: {why}")

    if config.modules_to_save:
        raise refuse(f"modules_to_save ({', '.join(sorted(config.modules_to_save))}) is not supported: only "
                     "low-rank deltas of the projections are served, not replaced modules")
    if not 1 <= config.r <= max_rank:
        raise refuse(f"rank {config.r} is above --max-lora-rank {max_rank}")
    # A list names modules, by name or by a path ending in one (PEFT saves "all-linear" as the
    # paths it matched); a string is PEFT's regex over module paths, which may match what it will:
    # the weights' own names are checked as they are read.
    targets = config.target_modules
    names = set() if isinstance(targets, str) else {t.rsplit(".", 1)[-1] for t in targets or ()}
    unknown = names - set(TARGET_MODULES) - set(FUSED_MODULES)
    if unknown:
        raise refuse(f"target_modules {sorted(unknown)} are not supported (any of "
                     f"{', '.join([*TARGET_MODULES, *FUSED_MODULES])})")
    unsupported = [what for what, on in (
        ("use_dora", config.use_dora), (f"bias={config.bias!r}", config.bias != "none"),
        ("lora_bias", getattr(config, "lora_bias", False)), ("layer_replication", config.layer_replication),
        ("trainable_token_indices", config.trainable_token_indices),
        ("alora_invocation_tokens", getattr(config, "alora_invocation_tokens", None)),
    ) if on]
    if unsupported:
        raise refuse(f"{', '.join(unsupported)} is not supported")


def _check_shapes(name: str, layer: int, peft_module: str, parts: tuple[str, ...], a: torch.Tensor, b: torch.Tensor,
                  r: int, cfg) -> None:
    """A ``[r, in]`` and B ``[out, r]`` of module ``peft_module`` (our ``parts`` of it: B's rows
    are their outputs, in order)."""
    if layer >= cfg.num_hidden_layers:
        raise AdapterLoadError(f"LoRA adapter {name!r}: layer {layer} is past the model's {cfg.num_hidden_layers}")
    in_dim = projection_shape(cfg, parts[0])[0]
    out_dim = sum(projection_shape(cfg, part)[1] for part in parts)
    if a.shape != (r, in_dim) or b.shape != (out_dim, r):
        raise AdapterLoadError(
            f"LoRA adapter {name!r}: layer {layer} {peft_module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
            f"the model needs ({r}, {in_dim}) and ({out_dim}, {r}): an adapter of another base model?")


def projection_shape(cfg, module: str) -> tuple[int, int]:
    """(in, out) features of projection ``module`` of the whole model (before any TP cut)."""
    from llmserve.common.basemodel.model_shape import head_dim, num_kv_heads

    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * head_dim(cfg), num_kv_heads(cfg) * head_dim(cfg)
    return {"q": (hidden, q), "k": (hidden, kv), "v": (hidden, kv), "o": (q, hidden),
            "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}[module]


class AdapterCache:
    """A worker's adapters read on the host: each known one is read (and so checked) once at
    start-up, and the ``capacity`` most recently loaded stay read (None: all); the others are read
    again from their directory when the engine loads them into a slot. With ``pack`` (the device
    pool's ``LoraPool.pack``) each is kept as ``pack`` makes it, ready for the pool to copy."""

    def __init__(self, adapters: dict[str, str], network_config, max_rank: int, capacity: int | None,
                 pack: Callable[[LoraAdapter], Any] | None = None):
        self.network_config, self.max_rank, self.capacity, self.pack = network_config, max_rank, capacity, pack
        self._read: OrderedDict[str, tuple[str, Any]] = OrderedDict()    # name -> (path, adapter)
        for name, path in adapters.items():
            self.get(name, path)

    def get(self, name: str, path: str) -> Any:
        """Adapter ``name`` at ``path``: a ``LoraAdapter``, or what ``pack`` makes of it."""
        entry = self._read.get(name)
        if entry is None or entry[0] != path:
            adapter = read_adapter(name, path, self.network_config, self.max_rank)
            entry = self._read[name] = (path, self.pack(adapter) if self.pack is not None else adapter)
        self._read.move_to_end(name)
        while self.capacity is not None and len(self._read) > max(1, self.capacity):
            self._read.popitem(last=False)
        return entry[1]
