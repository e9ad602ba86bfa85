"""The fused MoE kernel (``llmserve.kernels.fused_moe``) against the floor of the expert weights
it must read.

What is measured
  One MoE layer's experts with a model's shapes (``--shape``: Qwen3-30B-A3B's 128 experts of
  768 over hidden 2048, top 8; Mixtral-8x7B's 8 of 14336 over 4096, top 2; ``--tp`` cuts each
  expert's intermediate size as a tensor-parallel rank holds it), random weights, and for each
  batch size random router logits through ``select_experts`` (softmax, top-k, renormalised).
  Timed: ``fused_moe`` (the align launch and the two grouped GEMMs, plus the sum over top-k), as
  a median of single calls each after an L2 flush (cold caches, GPU time), and in a CUDA graph
  (``graph us``: back to back, as a captured decode step runs it; includes launch gaps).

Columns
  experts hit   distinct experts the batch's routing picked (measured from the router's ids)
  floor us      (experts hit x one expert's gate, up and down bytes + x and output bytes) /
                measured device-to-device copy bandwidth: reading each touched expert once
  ours/floor    the cold-cache time over the floor (1.0 would be perfect)
  align us      the align launch alone (16-row blocks)

``--sweep`` also times other tile sizes (BLOCK_N, BLOCK_K, warps, stages; BLOCK_M as the kernel
picks it) at each batch size and prints the fastest, to tune ``fused_moe._block_config`` with.

Run (GPU):   python benchmarks/fused_moe.py --json benchmarks/results/fused_moe.json
             python benchmarks/fused_moe.py --shape mixtral-8x7b --tp 2
Smoke (CPU): TRITON_INTERPRET=1 python benchmarks/fused_moe.py --device cpu --shape tiny --batch-sizes 1,4
             (Triton's interpreter: checks the script, not the kernel's speed)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass

import torch

from common import (
    add_device_arguments,
    cuda_time_ms,
    device_name,
    dtype_name,
    environment,
    graph_us,
    markdown_table,
    measure_copy_bandwidth,
    remove_script_dir_from_sys_path,
    resolve_dtype,
    write_json,
)

remove_script_dir_from_sys_path()

from llmserve.kernels import fused_moe as fused_moe_module  # noqa: E402
from llmserve.kernels.fused_moe import fused_moe_torch, fused_moe_triton, moe_align  # noqa: E402
from llmserve.kernels.moe_route import select_experts  # noqa: E402

# (hidden, intermediate per expert, experts, top-k)
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "tiny": (64, 32, 8, 2),
}


@dataclass
class Row:
    batch: int
    experts_hit: int
    ms: float
    graph_us: float | None
    align_us: float
    floor_us: float
    ours_over_floor: float


def run(shape: str, batch: int, device: torch.device, dtype: torch.dtype, copy_bw: float,
        w13: torch.Tensor, w2: torch.Tensor) -> Row:
    hidden, _, experts, top_k = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(batch)
    x = torch.randn(batch, hidden, generator=gen, device=device, dtype=dtype)
    weights, ids = select_experts(torch.randn(batch, experts, generator=gen, device=device), top_k, renormalize=True)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    if batch <= 64:  # the twin loops over experts in Python: a check, affordable at these sizes
        want = fused_moe_torch(x, w13, w2, weights, ids)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        if err > (1e-4 if dtype == torch.float32 else 2e-2):
            raise RuntimeError(f"batch {batch}: the kernel differs from its twin by {err:.2e} (relative)")
    hit = int(ids.unique().numel())
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    floor_us = (hit * per_expert + 2 * x.numel() * x.element_size()) / copy_bw * 1e6
    iters = dict(warmup=10, iters=100) if device.type == "cuda" else dict(warmup=1, iters=2)  # CPU: the interpreter
    ms = cuda_time_ms(lambda: fused_moe_triton(x, w13, w2, weights, ids), device=device, **iters)
    align_ms = cuda_time_ms(lambda: moe_align(ids, experts, 16), device=device, **iters)
    graphed = graph_us(lambda: fused_moe_triton(x, w13, w2, weights, ids)) if device.type == "cuda" else None
    return Row(batch, hit, ms, graphed, align_ms * 1e3, floor_us, ms * 1e3 / floor_us)


SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st)
         for n in (32, 64, 128) for k in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]


def sweep(shape: str, batch: int, device: torch.device, dtype: torch.dtype, w13: torch.Tensor,
          w2: torch.Tensor) -> list[tuple[float, dict]]:
    """(cold-cache ms, tiles) of every SWEEP entry that compiles and fits, fastest first."""
    hidden, _, experts, top_k = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(batch)
    x = torch.randn(batch, hidden, generator=gen, device=device, dtype=dtype)
    weights, ids = select_experts(torch.randn(batch, experts, generator=gen, device=device), top_k, renormalize=True)
    default = fused_moe_module._block_config
    timed = []
    try:
        for tiles in SWEEP:
            cfg = default(batch * top_k, experts, dtype) | tiles
            fused_moe_module._block_config = lambda *_: cfg
            try:
                timed.append((cuda_time_ms(lambda: fused_moe_triton(x, w13, w2, weights, ids), device=device), cfg))
            except Exception as e:  # out of shared memory, and the like
                print(f"batch {batch}, {tiles}: {type(e).__name__}", file=sys.stderr)
    finally:
        fused_moe_module._block_config = default
    return sorted(timed, key=lambda t: t[0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tp", type=int, default=1, help="each expert's intermediate size / tp, as one rank holds it")
    p.add_argument("--batch-sizes", default="1,8,64,256")
    p.add_argument("--sweep", action="store_true", help="also time other tile sizes (CUDA)")
    add_device_arguments(p)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    hidden, inter, experts, top_k = SHAPES[args.shape]
    inter //= args.tp
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device, dtype=dtype).mul_(hidden ** -0.5)
    w2 = torch.randn(experts, hidden, inter, generator=gen, device=device, dtype=dtype).mul_(inter ** -0.5)
    copy_bw = measure_copy_bandwidth(device)
    rows = [run(args.shape, int(b), device, dtype, copy_bw, w13, w2) for b in args.batch_sizes.split(",")]

    print(f"\n### fused_moe, {args.shape} experts ({experts} x [{2 * inter} + {inter}] x {hidden}, top {top_k}"
          f"{f', tp={args.tp}' if args.tp > 1 else ''}), {dtype_name(dtype)}, {device_name(device)}, "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s\n")
    print(markdown_table(
        ["batch", "experts hit", "ours us", "graph us", "align us", "floor us", "ours/floor"],
        [[r.batch, r.experts_hit, f"{r.ms * 1e3:.1f}", "-" if r.graph_us is None else f"{r.graph_us:.1f}",
          f"{r.align_us:.1f}", f"{r.floor_us:.1f}", f"{r.ours_over_floor:.2f}"] for r in rows]))
    best = {}
    if args.sweep and device.type == "cuda":
        for r in rows:
            timed = sweep(args.shape, r.batch, device, dtype, w13, w2)
            best[r.batch] = [(ms * 1e3, cfg) for ms, cfg in timed[:5]]
            print(f"batch {r.batch}: default {r.ms * 1e3:.1f} us; fastest " +
                  "; ".join(f"{us:.1f} us {cfg}" for us, cfg in best[r.batch][:3]))
    if args.json:
        write_json(args.json, {"benchmark": "fused_moe", "sweep_fastest_us": best, "environment": environment(device), "shape": args.shape,
                               "tp": args.tp, "dtype": dtype_name(dtype), "copy_bandwidth_bytes_per_s": copy_bw,
                               "results": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
