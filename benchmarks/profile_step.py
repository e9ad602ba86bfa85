"""Where one decode step's time goes: the GPU kernels of a few steps of a random-weight model
(offline.py's shapes, Llama-3-8B by default), grouped by kernel, next to the step's wall time.

    python benchmarks/profile_step.py --batch 1 --prompt-len 512 [--graphs]
        [--model-size gemma2-9b] [--quantization fp8|fp8-block|int4] [--lora 8] [--verify 4]
        [--tp 2 [--all-reduce custom|unfused|one-way|one-way-push|nccl]]

``--lora N`` loads N random rank-16 adapters on every projection (lora.py's) and gives request i
adapter i mod N. ``--verify K`` profiles speculative verify steps of 1 + K tokens a request
instead (random drafts, every row's logits, the drafts then cut: offline.py's ``--verify``).

``--tp N`` runs N ranks, one GPU each (NCCL, and the custom all-reduce unless ``--all-reduce
nccl``; ``unfused`` turns its fusion with the add and norm off), and profiles rank 0's share.
``--device cpu`` runs the same on the CPU (gloo, fp32, the ops' CPU times): a smoke test of the
script, e.g. ``--device cpu --model-size tiny --tp 2 --prompt-len 16 --steps 2``.

Each kernel row also gives the median and the longest of its calls: a kernel whose calls vary
widely waits on something (at tp > 1, the first all-reduce of a step waits for the other ranks'
graph launches).

If the kernels' summed time is well below the step time, the step is bound by host-side work
(Python, launches, synchronisations), not by the GPU. The sum counts kernel rows only: the
profiler also lists each aten op with the time of the kernels it launched, and adding those
counted every kernel twice.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # --tp's spawned ranks re-import this file
from offline import BENCH_QUANTIZERS, CONFIGS, build_model, prefill, quantized_linears, random_hf_weights  # also takes this folder off sys.path (see common.py)


def load_sibling(name: str):
    """A script of this folder as a module (common.py takes the folder off sys.path)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--graphs", action="store_true", help="replay the decode step's CUDA graph (as the server does)")
    ap.add_argument("--model-size", choices=sorted(CONFIGS), default="8b")
    ap.add_argument("--quantization", choices=["fp8", *BENCH_QUANTIZERS], default=None)
    ap.add_argument("--lora", type=int, default=0, metavar="N", help="N random rank-16 adapters, request i on i mod N")
    ap.add_argument("--verify", type=int, default=0, metavar="K", help="verify steps of 1 + K tokens a request")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one GPU each; rank 0 is profiled")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke test (gloo, fp32)")
    ap.add_argument("--all-reduce", choices=["custom", "unfused", "one-way", "one-way-push", "nccl"], default="custom",
                    help="at --tp > 1: the custom all-reduce fused with the add and norm (default), without the "
                         "fusion, the fused kernel's flagless protocol, or NCCL's")
    args = ap.parse_args()
    if args.tp > 1 and args.lora:
        ap.error("--lora is profiled at --tp 1 only")
    if args.tp == 1:
        profile_rank(args, torch.device(args.device))
        return
    from llmserve.common.custom_all_reduce import FUSED_ENV_VAR
    from llmserve.engine.worker_client import free_tcp_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")    # NVLink multicast stays off (custom_all_reduce.py)
    if args.all_reduce in ("unfused", "one-way", "one-way-push"):   # the spawned ranks inherit it
        os.environ[FUSED_ENV_VAR] = "0" if args.all_reduce == "unfused" else args.all_reduce
    mp.start_processes(rank_main, args=(args, free_tcp_port()), nprocs=args.tp, start_method="spawn")


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    """One tensor-parallel rank: joined as the server's workers join (``init_distributed``)."""
    from llmserve.common.distributed import all_reduce_description, init_distributed

    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, args.tp, is_master=rank == 0)
    init_distributed(store, rank, args.tp, device, custom_all_reduce=args.all_reduce != "nccl")
    if rank == 0:
        print(f"tp={args.tp}, all-reduce: {all_reduce_description()}", flush=True)
    profile_rank(args, device, rank)
    dist.barrier()
    os._exit(0)   # torch's teardown may not return once symmetric memory was mapped (test_custom_all_reduce)


def profile_rank(args: argparse.Namespace, device: torch.device, rank: int = 0) -> None:
    """Build the model (this rank's share), run a few steps, and (rank 0) print their kernels."""
    cfg = CONFIGS[args.model_size]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = None
    if args.quantization in BENCH_QUANTIZERS:
        weights = quantized_linears(random_hf_weights(cfg, device, dtype), BENCH_QUANTIZERS[args.quantization])
    model = build_model(cfg, device, dtype, args.batch, args.prompt_len + args.steps + 16 + args.verify,
                        graphs=args.graphs, weights=weights,
                        quantization="fp8" if args.quantization == "fp8" else None, speculate=args.verify,
                        tp_rank=rank, world_size=args.tp)
    slots = None
    if args.lora:
        from llmserve.lora.pool import LoraPool

        random_adapter = load_sibling("lora").random_adapter

        pool = LoraPool(model.network_config_, args.lora, 16, 0, 1, model.data_type, device)
        pool.widen(model.trans_layers_weight)     # as the model's own pool does
        for slot in range(args.lora):
            pool.load(slot, random_adapter(model.network_config_, f"a{slot}", 16, seed=slot))
        model.lora_pool = pool
        if model.decode_graphs is not None:   # captured again with the pool in place (see lora.py)
            model.req_manager.free_req(model.decode_graphs.pad_row)
            model.decode_graphs = model._init_decode_graphs()
        slots = [i % args.lora for i in range(args.batch)]
    rows = [model.req_manager.alloc_req() for _ in range(args.batch)]
    tokens = prefill(model, rows, args.prompt_len).argmax(-1)
    lens = [args.prompt_len] * args.batch

    drafts = torch.randint(model.vocab_size, (args.batch, args.verify), device=device)

    def step() -> None:
        nonlocal tokens, lens
        if args.verify:    # every row's logits; the token after the first row's goes on, the drafts are cut
            ids = torch.cat([tokens[:, None], drafts], dim=1).flatten()
            logits = model.forward(ids, rows, lens, [1 + args.verify] * args.batch, b_lora_slot=slots,
                                   return_all_logits=True)
            tokens = logits.argmax(-1).view(args.batch, 1 + args.verify)[:, 0]
            lens = [n + 1 for n in lens]
            model.req_manager.truncate_batch(rows, lens)
            return
        tokens = model.forward(tokens, rows, lens, [1] * args.batch, b_lora_slot=slots).argmax(-1)
        lens = [n + 1 for n in lens]

    on_gpu = device.type == "cuda"

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize(device)

    for _ in range(3):
        step()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_gpu) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    if rank != 0:
        return
    # On the CPU (a smoke test) the ops' own CPU times stand in for the kernels.
    device_type = DeviceType.CUDA if on_gpu else DeviceType.CPU
    kernels = [e for e in prof.key_averages() if e.device_type == device_type]
    time_us = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    gpu_ms = sum(time_us(e) for e in kernels) / 1e3 / args.steps
    launches = sum(e.count for e in kernels) / args.steps
    ranks = f"tp={args.tp} ({args.all_reduce if on_gpu else 'gloo'}), rank 0" if args.tp > 1 else ""
    what = " ".join(x for x in (args.model_size, args.quantization, f"lora x{args.lora}" if args.lora else "",
                                f"verify 1+{args.verify}" if args.verify else "", ranks) if x)
    unit = "kernels" if on_gpu else "ops"
    print(f"{what}, batch {args.batch}{' (CUDA graph)' if args.graphs else ''}: wall {wall_ms:.2f} ms/step, "
          f"{'GPU' if on_gpu else 'CPU'} {unit} {gpu_ms:.2f} ms/step ({launches:.0f} {unit} a step)", flush=True)
    # Each call's own time: a kernel whose calls vary widely waits on something (the custom
    # all-reduce's first call of a step waits for the ranks' graph launches to line up).
    calls_us: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == device_type:
            calls_us[e.name].append(e.time_range.elapsed_us())
    print(f"{'kernel':<80} {'ms/step':>8} {'calls/step':>10} {'median us':>9} {'max us':>8}")
    for e in sorted(kernels, key=lambda e: -time_us(e))[:18]:
        each = sorted(calls_us.get(e.key, [])) or [float("nan")]
        print(f"{e.key[:80]:<80} {time_us(e) / 1e3 / args.steps:8.3f} {e.count / args.steps:10.0f} "
              f"{each[len(each) // 2]:9.1f} {each[-1]:8.1f}", flush=True)


if __name__ == "__main__":
    main()
