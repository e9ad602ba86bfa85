"""LoRA adapters' cost: decode steps with adapters beside the base model's, and loading one.

What is measured
  A ``LlamaTpPartModel`` with Llama-3-8B's shapes and random weights (as ``offline.py``; bf16),
  and ``--num-adapters`` random adapters of rank ``--rank`` on every projection (q, k, v, o, gate,
  up, down), each in a slot of the model's device pool (``--max-lora-rank`` = the rank).

  1. base: decode steps of the base model (no pool: the layers as without LoRA), for each batch
     size, timed as ``offline.py`` times them (random prompts of ``--prompt-len`` tokens
     prefilled, ``--warmup-steps`` untimed steps, then ``--steps`` timed between CUDA events);
  2. lora: the same model with the pool attached (the CUDA graphs captured again, now with the
     adapters' kernels), every request with an adapter, request i using adapter i mod
     ``--num-adapters``: a batch of 32 spreads over 8 adapters. (The prompts' KV is prefilled
     by the base model; only the decode steps are timed, and their cost does not depend on it.)
  3. load: putting one more adapter into a slot on demand, median of ``--load-repeats``: from
     host memory (the worker's cache of read adapters, ``--max-cpu-loras``, which keeps them
     packed in the pool's layout: ``LoraPool.pack``), and from its PEFT directory on disk (read
     and checked, packed, then put in the slot), with the device synchronised; the read and the
     pack are also timed alone.

The pool widens the base weights as the model's own does (``LoraPool.widen``: every slot's A below
the weight it wraps), and each projection group takes the route ``LoraBatch.route`` times faster at
its shape: the widened GEMM, or the shrink on a side stream beside the base projection.
``--no-widen`` leaves the weights as they are (the side-stream route everywhere);
``--no-side-stream`` runs that route's shrink on the main stream before its base projection.

Columns
  ms/step, tok/s    as offline.py
  x base            lora tok/s / base tok/s at the same batch (decode throughput kept)
  step x base       lora ms/step / base ms/step

The issue's targets: batch 32 over 8 adapters >= 0.85x base decode throughput; batch 1 with an
adapter <= 1.1x the base step; an on-demand load < 50 ms.

The batch order: on one H200 (2026-11-28, session 38) ``--batch-sizes 32`` alone read the LoRA
step at batch 32 as 7.76 ms against 6.50-6.53 in every ``1,32`` run of the same kernels; on the
next session's H200 both orders read the same (6.54 / 6.64 / 6.54 ms: 32, then 1,32, then 32).
The JSON lists autotune's choices (``autotune``: the routes, cuBLAS or our skinny GEMM), the
first thing to compare when two runs disagree.

Run (GPU):   python benchmarks/lora.py --json benchmarks/results/lora.json
Smoke (CPU): python benchmarks/lora.py --device cpu --model-size tiny --batch-sizes 1,4 --prompt-len 16 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

import torch

from common import add_device_arguments, environment, markdown_table, resolve_dtype, wall_median_ms, write_json
from offline import CONFIGS, build_model, prefill
from common import IntervalTimer, gc_paused  # noqa: E402  (common is imported already: offline's fix of sys.path ran)

from llmserve.lora.adapter import TARGET_MODULES, LoraAdapter, projection_shape, read_adapter  # noqa: E402
from llmserve.kernels.autotune import decisions  # noqa: E402
from llmserve.lora.pool import LoraPool  # noqa: E402


def random_adapter(cfg, name: str, rank: int, seed: int) -> LoraAdapter:
    """An adapter of ``rank`` on every projection, on the host (as a worker keeps read adapters)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg.num_hidden_layers):
        for module in TARGET_MODULES.values():
            n_in, n_out = projection_shape(cfg, module)
            weights[(layer, module)] = (torch.randn(rank, n_in, generator=gen) * 0.01,
                                        torch.randn(n_out, rank, generator=gen) * 0.01)
    return LoraAdapter(name, "", rank, 2.0, weights)


def save_peft_dir(adapter: LoraAdapter, path: str) -> None:
    """``adapter`` as a PEFT adapter directory (the format ``--lora-modules`` reads)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    modules = {v: k for k, v in TARGET_MODULES.items()}
    LoraConfig(r=adapter.rank, lora_alpha=2 * adapter.rank, target_modules=list(TARGET_MODULES)).save_pretrained(path)
    tensors = {}
    for (layer, module), (a, b) in adapter.weights.items():
        block = "self_attn" if module in ("q", "k", "v", "o") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{block}.{modules[module]}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a.contiguous(), b.contiguous()
    save_file(tensors, f"{path}/adapter_model.safetensors")


def decode_ms(model, batch: int, prompt_len: int, warmup: int, steps: int, slots: list[int] | None) -> list[float]:
    """The timed decode steps' milliseconds of ``batch`` requests (adapter ``slots[i]``; None: base)."""
    rows = [model.req_manager.alloc_req() for _ in range(batch)]
    try:
        tokens = prefill(model, rows, prompt_len).argmax(-1)
        lens = [prompt_len] * batch
        timer = IntervalTimer(model.device)
        with gc_paused():
            for _ in range(warmup + steps):
                timer.start()
                tokens = model.forward(tokens, rows, lens, [1] * batch, b_lora_slot=slots).argmax(-1)
                timer.stop()
                lens = [n + 1 for n in lens]
        return timer.elapsed_ms()[warmup:]
    finally:
        for row in rows:
            model.req_manager.free_req(row)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated (default: 1,32)")
    p.add_argument("--num-adapters", type=int, default=8, help="adapters in the pool, spread over a batch (default: 8)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--load-repeats", type=int, default=5)
    p.add_argument("--model-size", choices=["8b", "tiny"], default="8b")
    p.add_argument("--no-graphs", action="store_true", help="eager decode steps (graphs are used on CUDA otherwise)")
    p.add_argument("--no-side-stream", action="store_true",
                   help="each shrink on the main stream before its base projection, not beside it")
    p.add_argument("--no-widen", action="store_true",
                   help="leave the base weights as they are (no wide route: every shrink a kernel of its own)")
    add_device_arguments(p)
    return p.parse_args()


@torch.inference_mode()
def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    graphs = device.type == "cuda" and not args.no_graphs
    model = build_model(CONFIGS[args.model_size], device, dtype, max(batches),
                        args.prompt_len + args.warmup_steps + args.steps, graphs=graphs)
    cfg = model.network_config_
    print(f"model built ({args.model_size}, {dtype}, graphs={graphs}); base steps ...", file=sys.stderr)
    timing = (args.prompt_len, args.warmup_steps, args.steps)
    base = {b: statistics.mean(decode_ms(model, b, *timing, None)) for b in batches}

    pool = LoraPool(cfg, args.num_adapters, args.rank, 0, 1, model.data_type, device)
    adapters = [random_adapter(cfg, f"a{i}", args.rank, seed=i) for i in range(args.num_adapters + 1)]
    for slot, adapter in enumerate(adapters[: args.num_adapters]):
        pool.load(slot, adapter)
    if not args.no_widen:
        pool.widen(model.trans_layers_weight)     # as the model's own pool does
    if args.no_side_stream:
        pool.side_stream = None
    model.lora_pool = pool
    if graphs:
        # Captured again, with the adapters' kernels; the old graphs' padding row goes back first
        # (the model has exactly one spare row for it).
        model.req_manager.free_req(model.decode_graphs.pad_row)
        model.decode_graphs = model._init_decode_graphs()
    print(f"pool: {args.num_adapters} slots of rank {args.rank}, {pool.nbytes / 2**20:.0f} MiB; adapter steps ...",
          file=sys.stderr)
    lora = {b: statistics.mean(decode_ms(model, b, *timing, [i % args.num_adapters for i in range(b)])) for b in batches}

    spare = adapters[-1]
    packed = pool.pack(spare)      # as the worker's cache holds it
    from_host = wall_median_ms(lambda: pool.load(0, packed), device, args.load_repeats)
    with tempfile.TemporaryDirectory() as d:
        save_peft_dir(spare, d)
        from_disk = wall_median_ms(lambda: pool.load(0, pool.pack(read_adapter("spare", d, cfg, args.rank))), device,
                                   args.load_repeats)
        read_only = wall_median_ms(lambda: read_adapter("spare", d, cfg, args.rank), device, args.load_repeats)
        read = read_adapter("spare", d, cfg, args.rank)
        pack_only = wall_median_ms(lambda: pool.pack(read), device, args.load_repeats)

    rows = []
    for b in batches:
        rows.append(["base", b, f"{base[b]:.2f}", f"{b / base[b] * 1e3:.0f}", "", ""])
        rows.append([f"lora ({min(b, args.num_adapters)} adapters)", b, f"{lora[b]:.2f}", f"{b / lora[b] * 1e3:.0f}",
                     f"{base[b] / lora[b]:.3f}", f"{lora[b] / base[b]:.3f}"])
    print(markdown_table(["run", "batch", "ms/step", "tok/s", "x base", "step x base"], rows))
    print(f"\non-demand load of a rank-{args.rank} adapter into a slot: {from_host:.1f} ms from host memory, "
          f"{from_disk:.1f} ms from its PEFT directory (reading it {read_only:.1f} ms, packing it {pack_only:.1f} ms)")
    if args.json:
        write_json(args.json, {"environment": environment(device), "args": vars(args),
                               "base_ms_per_step": base, "lora_ms_per_step": lora,
                               "load_ms_from_host": from_host, "load_ms_from_disk": from_disk,
                               "read_ms": read_only, "pack_ms": pack_only, "autotune": decisions()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
