"""Quantized weights cut for tensor parallelism: two gloo ranks on CPU, each holding half of every
quantized layer (its scales and zeros cut with it), give the logits of one rank holding all of it.
One spawn of two ranks runs every format family, and the float8 KV cache, to pay the start-up once."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from parity_utils import BatchDriver, build_tiny_hf_model, load_ours, rel_err
from quant_utils import LINEARS, write_quantized
from transformers import LlamaConfig

PROMPTS = [[5, 17, 30, 2, 9], [44] * 3, list(range(100, 111))]
# FP8 W8A8 with static activation scales (per-channel weight scales: the checkpoint's per-tensor one
# copied per row, as the loader stores every FP8 weight) and per-token ones; FP8 in 64 x 64 blocks
# (a rank's 64 rows of k_proj, head size 64, must be whole blocks; 128 x 128 checkpoints need
# shards of 128); 4-bit in groups of 64.
FORMATS = {"ct-fp8-static": {}, "ct-fp8-dynamic": {}, "fp8-block": {"block": (64, 64)}, "gptq": {"group": 64}}
# The row-parallel layers (o_proj, down_proj) sum two halves: float32 in another order, and an FP8
# activation a rounding from a boundary may round the other way (test_formats' TOL). With per-token
# scales each rank also quantizes its half of their input by the half's own amax (as vLLM does),
# not the row's: other rounding points, as far from tp=1 as W8A8 is from the weights (measured 7.9%).
TOL = {"ct-fp8-static": 1e-3, "ct-fp8-dynamic": 0.15, "fp8-block": 1e-5, "gptq": 1e-5, "kv-fp8": 1e-5}
# The dense model with a float8 KV cache (--kv-cache-dtype fp8): each rank's pool holds its kv heads.
RUNS = {**{fmt: (fmt, {}) for fmt in FORMATS}, "kv-fp8": ("dense", {"kv_cache_dtype": "fp8"})}


def logits(model) -> dict[str, torch.Tensor]:
    driver = BatchDriver(model)
    try:
        return {"prefill": driver.prefill(PROMPTS).float(), "decode": driver.decode([1, 2, 3]).float()}
    finally:
        driver.free()


def _rank_main(rank: int, world: int, root: str, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for run, (folder, kw) in RUNS.items():
            got = logits(load_ours(f"{root}/{folder}", tp_rank=rank, world_size=world, device="cpu", dtype=torch.float32,
                                   **kw))
            if rank == 0:
                torch.save(got, f"{root}/{run}.pt")
    finally:
        dist.destroy_process_group()


def test_quantized_tp2_logits_match_tp1(tmp_path):
    from llmserve.engine.worker_client import free_tcp_port

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=511)
    model = build_tiny_hf_model(config, tmp_path / "dense")
    with torch.no_grad():   # linear weights as test_formats' (a layer's gain under 1, not 2.4)
        for name, p in model.named_parameters():
            if name.split(".")[-2] in LINEARS:
                p.mul_(1 / 3)
    model.save_pretrained(tmp_path / "dense")
    for fmt, kw in FORMATS.items():
        write_quantized(tmp_path / "dense", tmp_path / fmt, fmt, **kw)
    mp.start_processes(_rank_main, args=(2, str(tmp_path), free_tcp_port()), nprocs=2, start_method="spawn")
    errors = {}
    for run, (folder, kw) in RUNS.items():
        one = logits(load_ours(tmp_path / folder, device="cpu", dtype=torch.float32, **kw))
        two = torch.load(tmp_path / f"{run}.pt")
        for step in ("prefill", "decode"):
            errors[run, step] = max(rel_err(a, b) for a, b in zip(two[step], one[step]))
    print("\ntp=2 vs tp=1 logits, greatest relative error:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert all(err < TOL[fmt] for (fmt, _), err in errors.items()), errors
