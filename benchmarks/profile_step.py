"""Where one decode step's time goes: the GPU kernels of a few steps of the Llama-3-8B-shaped
random-weight model, grouped by kernel, next to the step's wall time.

    python benchmarks/profile_step.py --batch 1 --prompt-len 512 [--graphs]

If the kernels' summed time is well below the step time, the step is bound by host-side work
(Python, launches, synchronisations), not by the GPU. The sum counts kernel rows only: the
profiler also lists each aten op with the time of the kernels it launched, and adding those
counted every kernel twice.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from offline import LLAMA3_8B_CONFIG, build_model, prefill  # also takes this folder off sys.path (see common.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--graphs", action="store_true", help="replay the decode step's CUDA graph (as the server does)")
    args = ap.parse_args()
    device = torch.device("cuda")
    model = build_model(LLAMA3_8B_CONFIG, device, torch.bfloat16, args.batch, args.prompt_len + args.steps + 16,
                        graphs=args.graphs)
    rows = [model.req_manager.alloc_req() for _ in range(args.batch)]
    tokens = prefill(model, rows, args.prompt_len).argmax(-1)
    lens = [args.prompt_len] * args.batch

    def step() -> None:
        nonlocal tokens, lens
        tokens = model.forward(tokens, rows, lens, [1] * args.batch).argmax(-1)
        lens = [n + 1 for n in lens]

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
    launches = sum(e.count for e in kernels) / args.steps
    print(f"batch {args.batch}{' (CUDA graph)' if args.graphs else ''}: wall {wall_ms:.2f} ms/step, "
          f"GPU kernels {gpu_ms:.2f} ms/step ({launches:.0f} kernels a step)")
    print(f"{'kernel':<80} {'ms/step':>8} {'calls/step':>10}")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"{e.key[:80]:<80} {e.self_device_time_total / 1e3 / args.steps:8.3f} {e.count / args.steps:10.0f}")


if __name__ == "__main__":
    main()
