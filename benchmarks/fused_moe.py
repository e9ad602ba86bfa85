"""The fused MoE kernel (``llmserve.kernels.fused_moe``) against the floor of the expert weights
it must read.

What is measured
  One MoE layer's experts with a model's shapes (``--shape``: Qwen3-30B-A3B's 128 experts of
  768 over hidden 2048, top 8; Mixtral-8x7B's 8 of 14336 over 4096, top 2; ``--tp`` cuts each
  expert's intermediate size as a tensor-parallel rank holds it), random weights, and for each
  batch size random router logits through ``select_experts`` (softmax, top-k, renormalised).
  Timed: ``fused_moe`` (up to ``GEMV_MAX_TOKENS`` tokens the two GEMV launches, above them the
  align launch, the two grouped GEMMs and the sum over top-k), as a median of single calls each
  after an L2 flush (cold caches, GPU time), and in a CUDA graph (``graph us``: back to back, as
  a captured decode step runs it; includes launch gaps). Up to 16 tokens both paths are timed in
  a graph (``gemv graph``, ``grouped graph``), to place the switch between them. ``mlp graph``
  is the whole MoE MLP as a decode step runs it (router GEMV, ``select_experts``, ``fused_moe``),
  against ``mlp floor`` (the floor plus the router's weights).

Columns
  experts hit   distinct experts the batch's routing picked (measured from the router's ids)
  floor us      (experts hit x one expert's gate, up and down bytes + x and output bytes) /
                measured device-to-device copy bandwidth: reading each touched expert once
  ours/floor    the cold-cache time over the floor (1.0 would be perfect)
  align us      the align launch alone (16-row blocks; the GEMV path runs none)
  route us      ``select_experts`` alone, in a graph

``--sweep`` also times other tile sizes at each batch size and prints the fastest: for the
grouped GEMM (BLOCK_N, BLOCK_K, warps, stages; BLOCK_M as the kernel picks it), to tune
``fused_moe._block_config`` with, and up to ``GEMV_MAX_TOKENS`` tokens for the GEMV path
(``GATE_UP_TILES`` and ``down_tiles_for(top_k)``: BLOCK_N, largest BLOCK_K, warps).

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

from llmserve.common.basemodel.moe import MoeWeights, moe_forward  # noqa: E402
from llmserve.kernels import fused_moe as fused_moe_module  # noqa: E402
from llmserve.kernels.fused_moe import (  # noqa: E402
    GEMV_MAX_TOKENS,
    fused_moe_gemv,
    fused_moe_grouped,
    fused_moe_torch,
    fused_moe_triton,
    moe_align,
)
from llmserve.kernels.moe_route import select_experts  # noqa: E402

# (hidden, intermediate per expert, experts, top-k)
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "tiny": (64, 32, 8, 2),
}


# Batch sizes up to this are timed on both paths (in a graph).
BOTH_PATHS_MAX_TOKENS = 16


@dataclass
class Row:
    batch: int
    path: str                       # the path fused_moe takes: "gemv" or "grouped"
    experts_hit: int
    ms: float
    graph_us: float | None
    gemv_graph_us: float | None     # both paths, up to BOTH_PATHS_MAX_TOKENS tokens
    grouped_graph_us: float | None
    align_us: float
    route_us: float | None
    mlp_graph_us: float | None
    floor_us: float
    mlp_floor_us: float
    ours_over_floor: float


def routed_inputs(shape: str, batch: int, device: torch.device, dtype: torch.dtype):
    """x, router logits and their routing (select_experts), seeded by the batch size."""
    hidden, _, experts, top_k = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(batch)
    x = torch.randn(batch, hidden, generator=gen, device=device, dtype=dtype)
    logits = torch.randn(batch, experts, generator=gen, device=device)
    return x, logits, *select_experts(logits, top_k, renormalize=True)


def run(shape: str, batch: int, device: torch.device, dtype: torch.dtype, copy_bw: float,
        w13: torch.Tensor, w2: torch.Tensor, router: torch.Tensor) -> Row:
    _, _, experts, top_k = SHAPES[shape]
    x, logits, weights, ids = routed_inputs(shape, batch, device, dtype)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    if batch <= 64:  # the twin loops over experts in Python: a check, affordable at these sizes
        want = fused_moe_torch(x, w13, w2, weights, ids)
        for name, out in [("fused_moe", got)] + ([("the grouped path", fused_moe_grouped(x, w13, w2, weights, ids))]
                                                 if batch <= GEMV_MAX_TOKENS else []):
            err = float((out.float() - want.float()).norm() / want.float().norm())
            if err > (1e-4 if dtype == torch.float32 else 2e-2):
                raise RuntimeError(f"batch {batch}: {name} differs from its twin by {err:.2e} (relative)")
    hit = int(ids.unique().numel())
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    floor_us = (hit * per_expert + 2 * x.numel() * x.element_size()) / copy_bw * 1e6
    mlp_floor_us = floor_us + router.numel() * router.element_size() / copy_bw * 1e6
    iters = dict(warmup=10, iters=100) if device.type == "cuda" else dict(warmup=1, iters=2)  # CPU: the interpreter
    ms = cuda_time_ms(lambda: fused_moe_triton(x, w13, w2, weights, ids), device=device, **iters)
    align_ms = cuda_time_ms(lambda: moe_align(ids, experts, 16), device=device, **iters)
    graphed = gemv = grouped = route = mlp = None
    if device.type == "cuda":
        graphed = graph_us(lambda: fused_moe_triton(x, w13, w2, weights, ids))
        if batch <= BOTH_PATHS_MAX_TOKENS:
            gemv = graph_us(lambda: fused_moe_gemv(x, w13, w2, weights, ids))
            grouped = graph_us(lambda: fused_moe_grouped(x, w13, w2, weights, ids))
        route = graph_us(lambda: select_experts(logits, top_k, renormalize=True))
        moe = MoeWeights(router=router, w13=w13, w2=w2, top_k=top_k, renormalize=True)
        mlp = graph_us(lambda: moe_forward(x, moe))
    path = "gemv" if batch <= GEMV_MAX_TOKENS else "grouped"
    return Row(batch, path, hit, ms, graphed, gemv, grouped, align_ms * 1e3, route, mlp, floor_us, mlp_floor_us,
               ms * 1e3 / floor_us)


SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st)
         for n in (32, 64, 128) for k in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]


def sweep(shape: str, batch: int, device: torch.device, dtype: torch.dtype, w13: torch.Tensor,
          w2: torch.Tensor) -> list[tuple[float, dict]]:
    """(cold-cache ms, tiles) of every SWEEP entry that compiles and fits, fastest first."""
    _, _, experts, top_k = SHAPES[shape]
    x, _, weights, ids = routed_inputs(shape, batch, device, dtype)
    default = fused_moe_module._block_config
    timed = []
    try:
        for tiles in SWEEP:
            cfg = default(batch * top_k, experts, dtype) | tiles
            fused_moe_module._block_config = lambda *_: cfg
            try:
                timed.append((cuda_time_ms(lambda: fused_moe_grouped(x, w13, w2, weights, ids), device=device), cfg))
            except Exception as e:  # out of shared memory, and the like
                print(f"batch {batch}, {tiles}: {type(e).__name__}", file=sys.stderr)
    finally:
        fused_moe_module._block_config = default
    return sorted(timed, key=lambda t: t[0])


GEMV_SWEEP = [(n, k, w) for n in (1, 2, 4, 8) for k in (256, 512, 1024, 2048) for w in (2, 4, 8)]


def sweep_gemv(shape: str, batch: int, device: torch.device, dtype: torch.dtype, w13: torch.Tensor,
               w2: torch.Tensor) -> dict[str, list[tuple[float, tuple[int, int, int]]]]:
    """The GEMV path's gate_up tiles (with the default down tiles), then its down tiles (with the
    fastest gate_up's): (cold-cache ms, tiles), fastest first, for each."""
    x, _, weights, ids = routed_inputs(shape, batch, device, dtype)
    best: dict[str, list[tuple[float, tuple[int, int, int]]]] = {}
    gate_up = fused_moe_module.GATE_UP_TILES
    for which in ("gate_up", "down"):
        timed = []
        for tiles in GEMV_SWEEP:
            kw = dict(gate_up_tiles=tiles) if which == "gate_up" else dict(gate_up_tiles=gate_up, down_tiles=tiles)
            try:
                timed.append((cuda_time_ms(lambda: fused_moe_gemv(x, w13, w2, weights, ids, **kw), device=device), tiles))
            except Exception as e:  # too many registers, and the like
                print(f"batch {batch}, {which} {tiles}: {type(e).__name__}", file=sys.stderr)
        best[which] = sorted(timed)
        if which == "gate_up" and timed:
            gate_up = best[which][0][1]
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tp", type=int, default=1, help="each expert's intermediate size / tp, as one rank holds it")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,64,256")
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
    router = torch.randn(experts, hidden, generator=gen, device=device, dtype=dtype).mul_(hidden ** -0.5)
    copy_bw = measure_copy_bandwidth(device)
    rows = [run(args.shape, int(b), device, dtype, copy_bw, w13, w2, router) for b in args.batch_sizes.split(",")]

    print(f"\n### fused_moe, {args.shape} experts ({experts} x [{2 * inter} + {inter}] x {hidden}, top {top_k}"
          f"{f', tp={args.tp}' if args.tp > 1 else ''}), {dtype_name(dtype)}, {device_name(device)}, "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s\n")
    def us(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    print(markdown_table(
        ["batch", "path", "experts hit", "ours us", "graph us", "gemv graph", "grouped graph", "align us", "route us",
         "floor us", "ours/floor", "mlp graph", "mlp floor", "mlp graph/floor"],
        [[r.batch, r.path, r.experts_hit, f"{r.ms * 1e3:.1f}", us(r.graph_us), us(r.gemv_graph_us),
          us(r.grouped_graph_us), f"{r.align_us:.1f}", us(r.route_us), f"{r.floor_us:.1f}", f"{r.ours_over_floor:.2f}",
          us(r.mlp_graph_us), f"{r.mlp_floor_us:.1f}",
          "-" if r.mlp_graph_us is None else f"{r.mlp_graph_us / r.mlp_floor_us:.2f}"] for r in rows]))
    best = {}
    if args.sweep and device.type == "cuda":
        for r in rows:
            timed = sweep(args.shape, r.batch, device, dtype, w13, w2)
            best[r.batch] = {"grouped": [(ms * 1e3, cfg) for ms, cfg in timed[:5]]}
            print(f"batch {r.batch}: grouped fastest " +
                  "; ".join(f"{us:.1f} us {cfg}" for us, cfg in best[r.batch]["grouped"][:3]))
            if r.batch <= GEMV_MAX_TOKENS:
                for which, timed_gemv in sweep_gemv(args.shape, r.batch, device, dtype, w13, w2).items():
                    best[r.batch][which] = [(ms * 1e3, tiles) for ms, tiles in timed_gemv[:5]]
                    print(f"batch {r.batch}: gemv {which} (defaults {fused_moe_module.GATE_UP_TILES} / "
                          f"{fused_moe_module.down_tiles_for(top_k)}) fastest " +
                          "; ".join(f"{us:.1f} us {t}" for us, t in best[r.batch][which][:3]))
    if args.json:
        write_json(args.json, {"benchmark": "fused_moe", "sweep_fastest_us": best, "environment": environment(device), "shape": args.shape,
                               "tp": args.tp, "dtype": dtype_name(dtype), "copy_bandwidth_bytes_per_s": copy_bw,
                               "results": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
