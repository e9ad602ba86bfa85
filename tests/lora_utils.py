"""Random LoRA adapters made by PEFT itself, and PEFT's greedy tokens with them: what the LoRA
tests hold our adapters against."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch

from parity_utils import hf_greedy_with_logits

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    r: int
    targets: tuple[str, ...] | str = ALL_TARGETS     # module names, or PEFT's regex over module paths
    alpha: int = 16
    rslora: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict, hash=False)   # more LoraConfig fields (tests of refusals)


def make_peft_adapter(hf_model, path, spec: AdapterSpec) -> str:
    """Save a PEFT adapter of ``hf_model`` (left unchanged) under ``path``, every lora_A and lora_B
    random (PEFT starts B at zero, which would add nothing)."""
    from peft import LoraConfig, get_peft_model

    targets = spec.targets if isinstance(spec.targets, str) else list(spec.targets)    # a str: PEFT's regex
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=targets, use_rslora=spec.rslora,
                        lora_dropout=0.0, **spec.extra)
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(str(path))
    return str(path)


def peft_model_of(hf_model, adapters: dict[str, str]):
    """``hf_model`` (a copy) with every adapter of ``adapters`` (name -> directory) loaded by PEFT."""
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(copy.deepcopy(hf_model), adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@contextlib.contextmanager
def adapter_active(peft_model, adapter: str | None):
    """``peft_model`` running ``adapter`` (None: the base model, its adapters disabled)."""
    if adapter is None:
        with peft_model.disable_adapter():
            yield peft_model
    else:
        peft_model.set_adapter(adapter)
        yield peft_model


def peft_greedy(peft_model, adapter: str | None, prompt: list[int], steps: int):
    """PEFT's greedy tokens and logits for ``prompt`` with ``adapter`` (None: the base model)."""
    with adapter_active(peft_model, adapter):
        return hf_greedy_with_logits(peft_model, prompt, steps)
