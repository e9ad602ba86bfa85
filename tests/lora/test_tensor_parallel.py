"""LoRA at tp=2 (two gloo ranks): each rank holds its cut of the adapters (B's rows of q/k/v/gate/up,
A's columns of o/down), and a batch mixing the base model and two adapters gives PEFT's logits
(which tp=1 gives too: tests/lora/test_model.py)."""

from __future__ import annotations

import functools

import torch
from lora_utils import ALL_TARGETS, AdapterSpec, adapter_active, make_peft_adapter, peft_model_of
from transformers import LlamaConfig

from llmserve.lora.adapter import read_adapter
from parity_utils import BatchDriver, build_tiny_hf_model, load_ours, rel_err, tp2_logits

PROMPTS = [[5, 17, 300, 2, 9], [44] * 3, list(range(100, 111))]
SLOTS = [0, -1, 1]
ADAPTERS = {"x": AdapterSpec(r=8, targets=ALL_TARGETS, seed=1),
            "y": AdapterSpec(r=4, targets=("k_proj", "o_proj", "up_proj", "down_proj"), alpha=32, seed=2)}


def _driver(path: str, adapters: list[str], rank: int, world: int) -> BatchDriver:
    model = load_ours(path, tp_rank=rank, world_size=world, device="cpu", dtype=torch.float32, max_loras=2,
                      max_lora_rank=8)
    for slot, (name, adapter_dir) in enumerate(zip(ADAPTERS, adapters)):
        model.lora_pool.load(slot, read_adapter(name, adapter_dir, model.network_config_, 8))
    return BatchDriver(model, lora_slots=SLOTS)


def test_llama_tp2_with_adapters_matches_peft(tmp_path):
    hf = build_tiny_hf_model(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=511), tmp_path / "model")
    dirs = {name: make_peft_adapter(hf, tmp_path / name, spec) for name, spec in ADAPTERS.items()}
    got = tp2_logits(functools.partial(_driver, str(tmp_path / "model"), list(dirs.values())), PROMPTS,
                     str(tmp_path / "logits.pt"))
    peft_model = peft_model_of(hf, dirs)
    with torch.no_grad():
        for i, (prompt, slot) in enumerate(zip(PROMPTS, SLOTS)):
            with adapter_active(peft_model, list(ADAPTERS)[slot] if slot >= 0 else None):
                ref = peft_model(torch.tensor([prompt + [i + 1]])).logits[0].float()
            assert rel_err(got["prefill"][i], ref[-2]) < 1e-4
            assert rel_err(got["decode"][i], ref[-1]) < 1e-4
