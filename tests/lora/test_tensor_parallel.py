"""LoRA at tp=2 (two gloo ranks): each rank holds its cut of the adapters (B's rows of q/k/v/gate/up,
A's columns of o/down), and a batch mixing the base model and two adapters gives PEFT's logits
(which tp=1 gives too: tests/lora/test_model.py)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from lora_utils import ALL_TARGETS, AdapterSpec, make_peft_adapter, peft_model_of
from transformers import LlamaConfig

from llmserve.lora.adapter import read_adapter
from parity_utils import BatchDriver, build_tiny_hf_model, load_ours, rel_err

PROMPTS = [[5, 17, 300, 2, 9], [44] * 3, list(range(100, 111))]
SLOTS = [0, -1, 1]
ADAPTERS = {"x": AdapterSpec(r=8, targets=ALL_TARGETS, seed=1),
            "y": AdapterSpec(r=4, targets=("k_proj", "o_proj", "up_proj", "down_proj"), alpha=32, seed=2)}


def _rank_main(rank: int, world: int, path: str, adapters: list[str], port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = load_ours(path, tp_rank=rank, world_size=world, device="cpu", dtype=torch.float32,
                          max_loras=2, max_lora_rank=8)
        for slot, (name, adapter_dir) in enumerate(zip(ADAPTERS, adapters)):
            model.lora_pool.load(slot, read_adapter(name, adapter_dir, model.network_config_, 8))
        driver = BatchDriver(model, lora_slots=SLOTS)
        prefill = driver.prefill(PROMPTS)
        decode = driver.decode([1, 2, 3])
        if rank == 0:
            torch.save({"prefill": prefill, "decode": decode}, out)
    finally:
        dist.destroy_process_group()


def test_llama_tp2_with_adapters_matches_peft(tmp_path):
    from llmserve.engine.worker_client import free_tcp_port

    hf = build_tiny_hf_model(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=511), tmp_path / "model")
    dirs = {name: make_peft_adapter(hf, tmp_path / name, spec) for name, spec in ADAPTERS.items()}
    out = str(tmp_path / "logits.pt")
    mp.start_processes(_rank_main, args=(2, str(tmp_path / "model"), list(dirs.values()), free_tcp_port(), out),
                       nprocs=2, start_method="spawn")
    got = torch.load(out)
    peft_model = peft_model_of(hf, dirs)
    with torch.no_grad():
        for i, (prompt, slot) in enumerate(zip(PROMPTS, SLOTS)):
            ids = torch.tensor([prompt + [i + 1]])
            if slot < 0:
                with peft_model.disable_adapter():
                    ref = peft_model(ids).logits[0].float()
            else:
                peft_model.set_adapter(list(ADAPTERS)[slot])
                ref = peft_model(ids).logits[0].float()
            assert rel_err(got["prefill"][i], ref[-2]) < 1e-4
            assert rel_err(got["decode"][i], ref[-1]) < 1e-4
