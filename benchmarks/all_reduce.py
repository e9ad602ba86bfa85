"""All-reduce by message size on N GPUs (issue 34): NCCL against our custom all-reduce.

What is measured, for each message size (bf16, --sizes, 8 KiB .. 64 MiB by default), on N GPUs of
this machine (one process each, NCCL between them)
  nccl        ``torch.distributed.all_reduce`` (what every all-reduce was before)
  one-shot    ``CustomAllReduce`` forced to its one-shot kernel (symmetric memory)
  two-shot    forced to its two-shot kernel (world sizes 2, 4, 8)
  ours        ``common.distributed.all_reduce`` as the model calls it: the kernel
              ``custom_all_reduce.algorithm_for`` picks (named beside it), NCCL above its thresholds
  +norm       ours, then ``add_rmsnorm`` over the message as rows of --hidden (two launches: what a
              layer did before the fused kernel)
  fused       the fused all-reduce + residual add + norm (kernels/all_reduce_add_rmsnorm.py) forced
              at every size; the model takes it up to ``FUSED_MAX_BYTES`` (to be read off this
              column against +norm)
  one-way     the same kernel's flagless protocol (``LLMSERVE_FUSED_ALL_REDUCE=one-way``), forced
  floor       the bytes one GPU must receive, 2 (N - 1) / N x the message, at --nvlink-gbps (what
              a bandwidth-optimal all-reduce moves; latency ignored)
each eagerly (a loop of calls, launches included: a step that does not replay a graph) and inside
a CUDA graph (--graph-calls calls a graph, replayed --graph-replays times: a decode step), in
microseconds a call, the slowest rank's. Every kernel's sum is first checked against NCCL's
(bitwise at N = 2, to bf16 rounding above: see custom_all_reduce.py's sum order).

The thresholds in custom_all_reduce.py (ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES) are meant to be
read off this table: one-shot while it beats two-shot and NCCL, two-shot while it beats NCCL.

Run (GPUs):  python benchmarks/all_reduce.py --gpus 2 --json benchmarks/results/all_reduce-h100x2.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # spawned ranks re-import this file
from common import environment, graph_us, markdown_table, remove_script_dir_from_sys_path, write_json

remove_script_dir_from_sys_path()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from llmserve.common import distributed  # noqa: E402
from llmserve.kernels import add_rmsnorm_forward  # noqa: E402
from llmserve.common.custom_all_reduce import (  # noqa: E402
    ALIGNMENT, FUSED_ENV_VAR, ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES, CustomAllReduce, algorithm_for, human_bytes,
)

DEFAULT_SIZES = ",".join(str(8 << 10 << i) for i in range(14))   # 8 KiB .. 64 MiB
DTYPE = torch.bfloat16


def eager_us(fn, iters: int) -> float:
    """Microseconds a call over a loop of ``iters`` calls (launches included), after one untimed."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def slowest(us: float, device: torch.device) -> float:
    t = torch.tensor([us], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def check(custom: CustomAllReduce, nbytes: int, device: torch.device) -> None:
    """Each kernel's sum of random values against NCCL's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(nbytes // DTYPE.itemsize, generator=torch.Generator(device).manual_seed(rank), device=device,
                    dtype=DTYPE)
    ref = x.clone()
    dist.all_reduce(ref)
    for algorithm in ("one_shot", "two_shot") if custom.two_shot_max else ("one_shot",):
        got = custom.all_reduce(x.clone(), algorithm)
        if world == 2:
            assert torch.equal(got, ref), f"{algorithm} at {nbytes} bytes differs from NCCL"
        else:
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * world)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    sizes = [int(s) for s in args.sizes.split(",")]
    # A buffer that fits every size, so that either kernel can be timed at every size.
    largest = max(sizes)
    custom = CustomAllReduce(dist.group.WORLD, device, one_shot_max=largest, two_shot_max=largest, fused_max=largest)
    # What the model gets: the default thresholds, over the same buffer.
    auto = copy.copy(custom)
    auto.one_shot_max, auto.two_shot_max = ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES if custom.two_shot_max else 0
    auto.fuses_add_rmsnorm = False   # only the fused column runs the fused kernel (custom's layout, forced)
    distributed.set_custom_all_reduce(auto)
    kernels = {"nccl": lambda t: dist.all_reduce(t), "one-shot": lambda t: custom.all_reduce(t, "one_shot"),
               "ours": distributed.all_reduce}
    if custom.two_shot_max:
        kernels["two-shot"] = lambda t: custom.all_reduce(t, "two_shot")
    # The layer's sum, residual add and norm, of the message as rows of --hidden: h stays 0 (a sum of
    # zeros), the weight 1.
    h = torch.zeros(max(sizes) // DTYPE.itemsize, dtype=DTYPE, device=device)
    w = torch.ones(args.hidden, dtype=DTYPE, device=device)

    def unfused(t: torch.Tensor) -> torch.Tensor:
        rows = h[: t.numel()].view(-1, args.hidden)
        return add_rmsnorm_forward(rows, distributed.all_reduce(t).view(-1, args.hidden), w, 1e-6)

    def fused_by(instance: CustomAllReduce):
        def fused(t: torch.Tensor) -> torch.Tensor:
            rows = h[: t.numel()].view(-1, args.hidden)
            return instance.all_reduce_add_rmsnorm(t.view(-1, args.hidden), rows, w, 1e-6, True)
        return fused

    os.environ[FUSED_ENV_VAR] = "one-way"   # a second instance, over buffers of its own
    try:
        one_way = CustomAllReduce(dist.group.WORLD, device, one_shot_max=largest, two_shot_max=largest,
                                  fused_max=largest)
    finally:
        del os.environ[FUSED_ENV_VAR]

    kernels["+norm"], kernels["fused"], kernels["one-way"] = unfused, fused_by(custom), fused_by(one_way)
    rows = []
    for nbytes in sizes:
        assert nbytes % ALIGNMENT == 0, f"sizes must be multiples of {ALIGNMENT} bytes"
        check(custom, nbytes, device)
        t = torch.zeros(nbytes // DTYPE.itemsize, dtype=DTYPE, device=device)   # zeros: a sum of sums stays finite
        row = {"bytes": nbytes, "ours_picks": algorithm_for(nbytes, DTYPE, world, auto.one_shot_max, auto.two_shot_max),
               "floor_us": 2 * (world - 1) / world * nbytes / (args.nvlink_gbps * 1e3)}
        for name, fn in kernels.items():
            dist.barrier()
            row[f"{name}_eager_us"] = slowest(eager_us(lambda: fn(t), args.eager_iters), device)
            dist.barrier()
            row[f"{name}_graph_us"] = slowest(graph_us(lambda: fn(t), args.graph_calls, args.graph_replays), device)
        rows.append(row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    distributed.set_custom_all_reduce(None)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=None, help="ranks, one GPU each (default: every GPU)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes in bytes, comma-separated")
    p.add_argument("--nvlink-gbps", type=float, default=450.0,
                   help="one direction of one GPU's NVLink, GB/s, for the floor (H100/H200 SXM: 900 both ways)")
    p.add_argument("--hidden", type=int, default=4096, help="row width of the +norm and fused columns (default: 4096)")
    p.add_argument("--eager-iters", type=int, default=200)
    p.add_argument("--graph-calls", type=int, default=20)
    p.add_argument("--graph-replays", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    world = args.gpus or torch.cuda.device_count()
    if world < 2:
        print(f"needs >= 2 GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    # NVLink multicast stays off on the shared hosts (custom_all_reduce.py never uses it either).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from llmserve.engine.worker_client import free_tcp_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(rank_main, args=(world, free_tcp_port(), args, out), nprocs=world, start_method="spawn")
        with open(out) as f:
            rows = json.load(f)
    names = ["nccl", "one-shot", "two-shot", "ours"] if "two-shot_eager_us" in rows[0] else ["nccl", "one-shot", "ours"]
    names += ["+norm", "fused", "one-way"]
    headers = ["size", *[f"{n} eager" for n in names], *[f"{n} graph" for n in names], "ours picks", "floor"]
    table = [[human_bytes(r["bytes"]), *[f"{r[f'{n}_eager_us']:.1f}" for n in names],
              *[f"{r[f'{n}_graph_us']:.1f}" for n in names], r["ours_picks"], f"{r['floor_us']:.1f}"] for r in rows]
    print(f"\n### All-reduce of bf16 messages on {world} GPUs, us a call (the slowest rank's)\n")
    print(markdown_table(headers, table))
    if args.json:
        write_json(args.json, {"benchmark": "all_reduce", "world_size": world, "nvlink_gbps": args.nvlink_gbps,
                               "environment": environment(torch.device("cuda", 0)), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
