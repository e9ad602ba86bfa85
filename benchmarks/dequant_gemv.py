"""The one-row quantized GEMV (`kernels/dequant_linear.py`'s `_dequant_gemv_kernel`) on the GPU, on
Llama-3-8B's four layer shapes: every tile choice against the format's floor (its bytes over this
card's copy bandwidth), beside the bf16 GEMV ours runs for the same shape and cuBLAS's bf16 GEMV
(the peer), all in one process.

A decode step of a quantized model at batch 1 is these four GEMVs 32 times over, so "per step"
weights each shape by 32 (the LM head stays bf16 and is left out). Each shape is timed over enough
distinct weight copies (1.5 GB) that every call reads its weight from HBM, from a CUDA graph of
the calls (`common.graph_us`). gate_up runs with its activation (`dequant_gemv_act_and_mul`), as
the model does. "autotuned" is the tile the autotuner keeps (`kernels/autotune.py`); "best" the
fastest of the sweep, which is `GEMV_TILES` (with and without PREFETCH) unless ``--wide`` adds
more shapes of tile.

    python benchmarks/dequant_gemv.py [--formats fp8,int4,fp8-block] [--wide] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import triton

from common import graph_us, markdown_table, measure_copy_bandwidth, remove_script_dir_from_sys_path

remove_script_dir_from_sys_path()

from llmserve.kernels import dequant_linear as D  # noqa: E402
from llmserve.kernels import quantized_linear  # noqa: E402
from llmserve.kernels.gemv import ACTIVATIONS, gemv_act_and_mul  # noqa: E402
from llmserve.quantization.config import quantize_fp8, quantize_fp8_blocks, quantize_int4  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
QUANTIZE = {"fp8": quantize_fp8, "fp8-block": quantize_fp8_blocks, "int4": quantize_int4}


def wide_tiles(pack: int) -> list[triton.Config]:
    """More tile shapes than GEMV_TILES: 64 to 256 stored bytes a thread a K step, either loop."""
    tiles = []
    for n, k, w, prefetch in itertools.product((4, 8, 16, 32), (1024, 2048, 4096, 8192), (4, 8), (False, True)):
        if 64 <= n * k // pack // (32 * w) <= 256:
            tiles.append(triton.Config({"BLOCK_N": n, "BLOCK_K": k, "PREFETCH": prefetch}, num_warps=w, num_stages=1))
    return tiles


def sweep_configs(x: torch.Tensor, operands: tuple, wide: bool) -> list[triton.Config]:
    w, scale, _, block = operands
    configs = D.configs_for(x, w, scale, block)
    if not wide:
        return configs
    constexprs = D.kernel_layout(w, block)
    K = x.shape[-1]
    cv = min(D.CHUNK[constexprs["PACK"]], constexprs["GROUP"]) if constexprs["GROUP"] else D.CHUNK[constexprs["PACK"]]
    extra = [triton.Config({**c.kwargs, "CV": cv, "EVEN_K": K % c.kwargs["BLOCK_K"] == 0}, num_warps=c.num_warps,
                           num_stages=1) for c in wide_tiles(constexprs["PACK"]) if c.kwargs["BLOCK_K"] <= K]
    seen = {(tuple(sorted(c.kwargs.items())), c.num_warps) for c in configs}
    return configs + [c for c in extra if (tuple(sorted(c.kwargs.items())), c.num_warps) not in seen]


def tile_name(c: triton.Config) -> str:
    return f"{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']}/{c.num_warps}w{'/pf' if c.kwargs.get('PREFETCH') else ''}"


def time_shape(fmt: str, name: str, N: int, K: int, wide: bool) -> dict:
    act = "silu" if name == "gate_up" else ""
    dense = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
             for _ in range(max(2, math.ceil(1.5e9 / (N * K * 2))))]
    packed = [QUANTIZE[fmt](w).to(torch.device("cuda"), torch.bfloat16) for w in dense[:max(2, math.ceil(1.5e9 / (N * K)))]]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    turn_q, turn_d = itertools.cycle(packed), itertools.cycle(dense)

    def quantized(config=None):
        w, s, z, b = next(turn_q)._gemv_operands()
        if act:
            return D.dequant_gemv_act_and_mul_triton(x, w, s, z, b, act, config=config)
        return D.dequant_linear_triton(x, w, s, z, b, config=config)

    def cublas():
        y = torch.matmul(x, next(turn_d).t())
        return ACTIVATIONS[act](y) if act else y

    graph = lambda fn: graph_us(fn, calls=len(packed))   # noqa: E731
    row = {"format": fmt, "weight": name, "N": N, "K": K, "bytes": packed[0].nbytes}
    row["autotuned_us"] = graph(quantized)
    if act:
        row["bf16_ours_us"] = graph(lambda: gemv_act_and_mul(x, next(turn_d), act))
    else:
        row["bf16_ours_us"] = graph(lambda: quantized_linear.linear(x, next(turn_d)))
    row["cublas_bf16_us"] = graph(cublas)
    swept = {}
    for config in sweep_configs(x, packed[0]._gemv_operands(), wide):
        try:
            swept[tile_name(config)] = graph(lambda: quantized(config))
        except Exception as e:   # a tile past the registers or shared memory
            print(f"  {fmt} {name} {tile_name(config)}: {type(e).__name__}")
    row["swept_us"] = swept
    if not act:   # the autotuned tile against the float64 product of one copy
        w, s, z, b = packed[0]._gemv_operands()
        ref = x.double() @ packed[0].dequantize().to("cuda").double().t()
        got = D.dequant_linear_triton(x, w, s, z, b).double()
        row["max_rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
    del dense, packed
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="fp8,int4", help=f"comma-separated, of {sorted(QUANTIZE)}")
    p.add_argument("--wide", action="store_true", help="sweep more tile shapes than the autotuner's")
    p.add_argument("--json", help="write every row (and each tile's time) here")
    args = p.parse_args()
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = []
    for fmt in args.formats.split(","):
        table, step = [], {"floor": 0.0, "autotuned": 0.0, "best": 0.0, "bf16_ours": 0.0, "cublas": 0.0}
        for name, (N, K) in SHAPES.items():
            r = time_shape(fmt, name, N, K, args.wide)
            rows.append(r)
            floor = r["bytes"] / bandwidth * 1e6
            best = min(r["swept_us"], key=r["swept_us"].get)
            table.append([name, N, K, f"{floor:.1f}", f"{r['autotuned_us']:.1f}", f"{r['autotuned_us'] / floor:.2f}",
                          f"{r['swept_us'][best]:.1f} {best}", f"{r['swept_us'][best] / floor:.2f}",
                          f"{r['bf16_ours_us']:.1f}", f"{r['cublas_bf16_us']:.1f}"])
            for key, us in (("floor", floor), ("autotuned", r["autotuned_us"]), ("best", r["swept_us"][best]),
                            ("bf16_ours", r["bf16_ours_us"]), ("cublas", r["cublas_bf16_us"])):
                step[key] += LAYERS * us
            print(f"  {fmt} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["swept_us"].items(), key=lambda kv: kv[1])))
        print(f"\n{fmt}, one row")
        print(markdown_table(["weight", "N", "K", "floor µs", "autotuned µs", "x floor", "best tile µs", "x floor",
                              "bf16 ours µs", "cuBLAS bf16 µs"], table))
        print(f"per 8B step (32 layers, no LM head): floor {step['floor'] / 1e3:.3f} ms, autotuned "
              f"{step['autotuned'] / 1e3:.3f}, best tiles {step['best'] / 1e3:.3f}, bf16 ours {step['bf16_ours'] / 1e3:.3f}, "
              f"cuBLAS bf16 {step['cublas'] / 1e3:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
