"""A decode step's linear layers on the GPU: ours (`kernels/gemv.py` for one row,
`kernels/skinny_gemm.py` for 2-64 rows; what `kernels.linear` picks) against cuBLAS
(`torch.matmul`), on Llama-3-8B's five weight shapes, in bf16.

Each shape is timed over enough distinct weight copies (1.5 GB) that every call reads its weight
from HBM, as a decode step does; times are from a CUDA graph of those calls (`common.graph_us`).
"TB/s" is the weight's bytes over the time. "per step" weights each shape by how often a step of
the 8B model runs it (32 layers, one LM head). "linear" is what `kernels.linear` runs (our kernel
where it is faster, else cuBLAS). `--sweep` also times every tile choice of the kernel for that row
count (gemv at one row, skinny_gemm above) and the best per shape: the tables behind the choices
in the kernel files.

`--tp 2` times one rank's share of each weight under tensor parallelism instead: qkv, gate_up and the
LM head split by output features, o and down by input features.

    python benchmarks/decode_linear.py [--rows 1,8,32,64] [--sweep] [--tp 1,2,4]
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from common import graph_us, markdown_table, measure_copy_bandwidth, remove_script_dir_from_sys_path

remove_script_dir_from_sys_path()

from llmserve.kernels import gemv as gemv_module  # noqa: E402
from llmserve.kernels import quantized_linear  # noqa: E402
from llmserve.kernels import skinny_gemm as skinny_module  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
# The dimension of each weight that tensor parallelism splits: 0 output features, 1 input features.
TP_SPLIT = {"qkv": 0, "o": 1, "gate_up": 0, "down": 1, "lm_head": 0}
# Each kernel's tile choices for --sweep: gemv's (BLOCK_N, largest BLOCK_K, num_warps) and
# skinny_gemm's (BLOCK_N, BLOCK_K, num_warps, num_stages).
SWEEP = {
    "gemv": [t for t in itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8)) if t[0] * t[1] <= 8192],
    "skinny_gemm": list(itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5))),
}


def time_shape(M: int, N: int, K: int, sweep: bool) -> tuple[float, float | None, dict, float]:
    """cuBLAS's time, `linear`'s (None where it is cuBLAS), each swept tile's, and linear's max error."""
    copies = max(2, math.ceil(1.5e9 / (N * K * 2)))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    want = x.double() @ ws[0].double().t()

    def rotating(fn):
        turn = itertools.cycle(range(copies))
        return lambda: fn(ws[next(turn)])

    cublas = graph_us(rotating(lambda w: torch.matmul(x, w.t())), calls=copies)
    ours = None
    if gemv_module.takes_gemv(x, ws[0]) or skinny_module.takes_skinny_gemm(x, ws[0]):
        ours = graph_us(rotating(lambda w: quantized_linear.linear(x, w)), calls=copies)
    err = (quantized_linear.linear(x, ws[0]).double() - want).abs().max().item()
    kernel = gemv_module.gemv_triton if M == 1 else skinny_module.skinny_gemm_triton
    swept = {}
    for tile in SWEEP["gemv" if M == 1 else "skinny_gemm"] if sweep else []:
        try:
            swept[tile] = graph_us(rotating(lambda w: kernel(x, w, tiles=tile)), calls=copies)
        except Exception as e:  # a tile too big for shared memory
            print(f"  {N}x{K} {tile}: {type(e).__name__}")
    return cublas, ours, swept, err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,64", help="comma-separated row counts (decode batch sizes)")
    p.add_argument("--sweep", action="store_true", help="also time every tile choice of the kernel")
    p.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes: time one rank's share")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
          f"copy bandwidth {measure_copy_bandwidth('cuda') / 1e12:.2f} TB/s")
    for tp, M in itertools.product((int(t) for t in args.tp.split(",")), (int(r) for r in args.rows.split(","))):
        rows, step = [], {"cuBLAS": 0.0, "ours": 0.0, "best": 0.0}
        for name, shape in SHAPES.items():
            N, K = (shape[0] // tp, shape[1]) if TP_SPLIT[name] == 0 else (shape[0], shape[1] // tp)
            cublas, ours, swept, err = time_shape(M, N, K, args.sweep)
            best = min(swept, key=swept.get) if swept else None
            gb = N * K * 2 / 1e3
            used = cublas if ours is None else ours
            rows.append([name, N, K, f"{cublas:.1f}", f"{gb / cublas / 1e3:.2f}",
                         "cuBLAS" if ours is None else f"{ours:.1f}", f"{gb / used / 1e3:.2f}",
                         f"{swept[best]:.1f} {best}" if best else "-", f"{err:.1e}"])
            step["cuBLAS"] += PER_STEP[name] * cublas
            step["ours"] += PER_STEP[name] * used
            step["best"] += PER_STEP[name] * min([used] + ([swept[best]] if best else []))
            torch.cuda.empty_cache()
        print(f"\n{M} row(s)" + (f", one rank of tp={tp}" if tp > 1 else ""))
        print(markdown_table(["weight", "N", "K", "cuBLAS µs", "TB/s", "linear µs", "TB/s", "best swept tile µs", "max err"], rows))
        print(f"per 8B step: cuBLAS {step['cuBLAS'] / 1e3:.3f} ms, linear {step['ours'] / 1e3:.3f} ms"
              + (f", best per shape {step['best'] / 1e3:.3f} ms" if args.sweep else ""))

if __name__ == "__main__":
    main()
