"""A decode step's linear layers on the GPU: ours (`kernels/gemv.py` for one row,
`kernels/skinny_gemm.py` for 2-64 rows; what `kernels.linear` picks) against cuBLAS
(`torch.matmul`), on Llama-3-8B's five weight shapes, in bf16.

Each shape is timed over enough distinct weight copies (1.5 GB) that every call reads its weight
from HBM, as a decode step does; times are from a CUDA graph of those calls (`common.graph_us`).
"TB/s" is the weight's bytes over the time. "per step" weights each shape by how often a step of
the 8B model runs it (32 layers, one LM head). `--sweep` also times every tile choice of the kernel
the row count uses, and the best per shape: the tables behind the defaults in the kernel files.

    python benchmarks/decode_linear.py [--rows 1,8,32,64] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import math
from types import ModuleType

import torch

from common import graph_us, markdown_table, remove_script_dir_from_sys_path

remove_script_dir_from_sys_path()

from llmserve.kernels import gemv as gemv_module  # noqa: E402
from llmserve.kernels import quantized_linear  # noqa: E402
from llmserve.kernels import skinny_gemm as skinny_module  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
# Each kernel's tile knobs (module constants) and the values --sweep tries.
TILES = {
    gemv_module: (("BLOCK_N", "MAX_BLOCK_K", "NUM_WARPS"),
                  [t for t in itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8)) if t[0] * t[1] <= 8192]),
    skinny_module: (("BLOCK_N", "BLOCK_K", "NUM_WARPS"),
                    list(itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8)))),
}


def set_tiles(module: ModuleType, tile: tuple[int, ...]) -> None:
    for name, value in zip(TILES[module][0], tile):
        setattr(module, name, value)


def time_shape(M: int, N: int, K: int, module: ModuleType, sweep: bool) -> tuple[float, dict, float]:
    copies = max(2, math.ceil(1.5e9 / (N * K * 2)))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    want = x.double() @ ws[0].double().t()

    def rotating(fn):
        turn = itertools.cycle(range(copies))
        return lambda: fn(ws[next(turn)])

    cublas = graph_us(rotating(lambda w: torch.matmul(x, w.t())), calls=copies)
    names, choices = TILES[module]
    default = tuple(getattr(module, n) for n in names)
    ours, err = {}, float("nan")
    for tile in [default] + (choices if sweep else []):
        set_tiles(module, tile)
        try:
            got = quantized_linear.linear(x, ws[0])
            if tile == default:
                err = (got.double() - want).abs().max().item()
            ours[tile] = graph_us(rotating(lambda w: quantized_linear.linear(x, w)), calls=copies)
        except Exception as e:  # a tile too big for shared memory
            print(f"  {module.__name__.rsplit('.', 1)[-1]} {tile}: {type(e).__name__}")
    set_tiles(module, default)
    return cublas, ours, err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,64", help="comma-separated row counts (decode batch sizes)")
    p.add_argument("--sweep", action="store_true", help="also time every tile choice of the kernel")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    for M in (int(r) for r in args.rows.split(",")):
        module = gemv_module if M == 1 else skinny_module
        x, w = torch.empty(M, 64, device="cuda", dtype=torch.bfloat16), torch.empty(8, 64, device="cuda", dtype=torch.bfloat16)
        assert (gemv_module.takes_gemv if M == 1 else skinny_module.takes_skinny_gemm)(x, w), f"linear sends {M} rows elsewhere"
        rows, step = [], {"cuBLAS": 0.0, "ours": 0.0, "best": 0.0}
        default = tuple(getattr(module, n) for n in TILES[module][0])
        for name, (N, K) in SHAPES.items():
            cublas, ours, err = time_shape(M, N, K, module, args.sweep)
            best = min(ours, key=ours.get)
            gb = N * K * 2 / 1e3
            rows.append([name, N, K, f"{cublas:.1f}", f"{gb / cublas / 1e3:.2f}", f"{ours[default]:.1f}",
                         f"{gb / ours[default] / 1e3:.2f}", f"{ours[best]:.1f} {best}", f"{err:.1e}"])
            for key, t in (("cuBLAS", cublas), ("ours", ours[default]), ("best", ours[best])):
                step[key] += PER_STEP[name] * t
            torch.cuda.empty_cache()
        print(f"\n{M} row(s): {module.__name__.rsplit('.', 1)[-1]}, tiles {dict(zip(TILES[module][0], default))}")
        print(markdown_table(["weight", "N", "K", "cuBLAS µs", "TB/s", "ours µs", "TB/s", "best tile µs", "max err"], rows))
        print(f"per 8B step: cuBLAS {step['cuBLAS'] / 1e3:.3f} ms, ours {step['ours'] / 1e3:.3f} ms"
              + (f", best tile per shape {step['best'] / 1e3:.3f} ms" if args.sweep else ""))


if __name__ == "__main__":
    main()
