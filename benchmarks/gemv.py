"""One-row linear layers (batch-1 decode) on the GPU: our Triton GEMV (`kernels/gemv.py`) against
cuBLAS (`torch.matmul`), on Llama-3-8B's five weight shapes, in bf16.

Each shape is timed over enough distinct weight copies (1.5 GB) that every call reads its weight
from HBM, as a decode step does; times are from a CUDA graph of those calls (`common.graph_us`).
"TB/s" is the weight's bytes over the time. "per step" weights each shape by how often a step of
the 8B model runs it (32 layers, one LM head). `--sweep` also times every tile choice in SWEEP, and
the best of them per shape: the table behind the defaults in kernels/gemv.py.

    python benchmarks/gemv.py [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from common import graph_us, markdown_table, remove_script_dir_from_sys_path

remove_script_dir_from_sys_path()

from llmserve.kernels import gemv as gemv_module  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
# (BLOCK_N, MAX_BLOCK_K, num_warps)
SWEEP = [(bn, bk, w) for bn, bk, w in itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8)) if bn * bk <= 8192]


def time_shape(N: int, K: int, tiles: list[tuple[int, int, int]]) -> tuple[float, dict, float]:
    copies = max(2, math.ceil(1.5e9 / (N * K * 2)))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    want = x.double() @ ws[0].double().t()

    def rotating(fn):
        turn = itertools.cycle(range(copies))
        return lambda: fn(ws[next(turn)])

    cublas = graph_us(rotating(lambda w: torch.matmul(x, w.t())), calls=copies)
    ours = {}
    default = (gemv_module.BLOCK_N, gemv_module.MAX_BLOCK_K, gemv_module.NUM_WARPS)
    for tile in [default] + [t for t in tiles if t != default]:
        gemv_module.BLOCK_N, gemv_module.MAX_BLOCK_K, gemv_module.NUM_WARPS = tile
        err = (gemv_module.gemv_triton(x, ws[0]).double() - want).abs().max().item()
        ours[tile] = graph_us(rotating(lambda w: gemv_module.gemv_triton(x, w)), calls=copies)
    gemv_module.BLOCK_N, gemv_module.MAX_BLOCK_K, gemv_module.NUM_WARPS = default
    return cublas, ours, err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="also time every tile choice in SWEEP")
    args = p.parse_args()
    default = (gemv_module.BLOCK_N, gemv_module.MAX_BLOCK_K, gemv_module.NUM_WARPS)
    rows, step_cublas, step_ours, step_best = [], 0.0, 0.0, 0.0
    for name, (N, K) in SHAPES.items():
        cublas, ours, err = time_shape(N, K, SWEEP if args.sweep else [])
        best = min(ours, key=ours.get)
        gb = N * K * 2 / 1e3
        rows.append([name, N, K, f"{cublas:.1f}", f"{gb / cublas / 1e3:.2f}", f"{ours[default]:.1f}",
                     f"{gb / ours[default] / 1e3:.2f}", f"{ours[best]:.1f} {best}", f"{err:.1e}"])
        step_cublas += PER_STEP[name] * cublas
        step_ours += PER_STEP[name] * ours[default]
        step_best += PER_STEP[name] * ours[best]
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, M = 1; default tiles "
          f"(BLOCK_N, MAX_BLOCK_K, warps) = {default}")
    print(markdown_table(["weight", "N", "K", "cuBLAS µs", "TB/s", "ours µs", "TB/s", "best tile µs", "max err"], rows))
    print(f"per 8B step: cuBLAS {step_cublas / 1e3:.3f} ms, ours {step_ours / 1e3:.3f} ms"
          + (f", best tile per shape {step_best / 1e3:.3f} ms" if args.sweep else ""))


if __name__ == "__main__":
    main()
