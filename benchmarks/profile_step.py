"""Where one decode step's time goes: the GPU kernels of a few steps of the Llama-3-8B-shaped
random-weight model, grouped by kernel, next to the step's wall time.

    python benchmarks/profile_step.py --batch 1 --prompt-len 512

If the kernels' summed time is well below the step time, the step is bound by host-side work
(Python, launches, synchronisations), not by the GPU.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from offline import LLAMA3_8B_CONFIG, build_model, prefill  # also takes this folder off sys.path (see common.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cuda")
    model = build_model(LLAMA3_8B_CONFIG, device, torch.bfloat16, args.batch, args.prompt_len + args.steps + 16)
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
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3 / args.steps
    print(f"batch {args.batch}: wall {wall_ms:.2f} ms/step, GPU kernels {gpu_ms:.2f} ms/step")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
