"""Sweep the context-attention kernel's tiles (BLOCK_M, BLOCK_N, warps, stages) on the GPU and
print the fastest per problem size, next to the current defaults. Its winners feed
`_default_tiles` in kernels/context_attention.py.

    python benchmarks/tune_context_attention.py
"""

from __future__ import annotations

import itertools

import torch

from common import cuda_time_ms, markdown_table, remove_script_dir_from_sys_path

remove_script_dir_from_sys_path()

from llmserve.kernels.context_attention import context_attention_fwd_triton  # noqa: E402

HQ, HKV, D = 32, 8, 128
# (name, requests, new tokens each, cached tokens each, BLOCK_M candidates)
PROBLEMS = [
    ("verify 64x5 on 1024", 64, 5, 1024, (16, 32)),
    ("chunk 8x64 on 1024", 8, 64, 1024, (16, 32, 64)),
    ("prefill 1x512", 1, 512, 0, (64, 128)),
    ("prefill 1x2048", 1, 2048, 0, (64, 128)),
    ("prefill 8x2048", 8, 2048, 0, (64, 128)),
]


def make_problem(bs: int, new: int, cached: int, dtype=torch.bfloat16):
    dev = "cuda"
    seq = new + cached
    pool = bs * seq
    q = torch.randn(bs * new, HQ, D, device=dev, dtype=dtype)
    kv = torch.randn(pool, 2 * HKV, D, device=dev, dtype=dtype)
    req_to_token = torch.randperm(pool, device=dev, dtype=torch.int32).view(bs, seq)
    i32 = lambda v: torch.tensor(v, device=dev, dtype=torch.int32)  # noqa: E731
    meta = (req_to_token, i32(list(range(bs))), i32([i * new for i in range(bs)]), i32([new] * bs), i32([cached] * bs), new)
    return q, kv[:, :HKV], kv[:, HKV:], torch.empty_like(q), meta


def main() -> None:
    rows = []
    for name, bs, new, cached, block_ms in PROBLEMS:
        q, k, v, o, meta = make_problem(bs, new, cached)
        flops = 4 * bs * HQ * D * sum(cached + j + 1 for j in range(new))
        default_ms = cuda_time_ms(lambda: context_attention_fwd_triton(q, k, v, o, *meta), warmup=10, iters=50)
        best = (default_ms, "default")
        for bm, bn, warps, stages in itertools.product(block_ms, (32, 64, 128), (4, 8), (1, 2, 3)):
            try:
                ms = cuda_time_ms(lambda: context_attention_fwd_triton(
                    q, k, v, o, *meta, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages), warmup=5, iters=30)
            except Exception:  # out of shared memory / registers for this tile
                continue
            if ms < best[0]:
                best = (ms, f"M{bm} N{bn} w{warps} s{stages}")
        rows.append([name, f"{default_ms * 1e3:.1f}", f"{flops / default_ms / 1e9:.0f}",
                     f"{best[0] * 1e3:.1f}", f"{flops / best[0] / 1e9:.0f}", best[1]])
        print(rows[-1], flush=True)
    print(markdown_table(["problem", "default µs", "default TFLOP/s", "best µs", "best TFLOP/s", "best tiles"], rows))


if __name__ == "__main__":
    main()
