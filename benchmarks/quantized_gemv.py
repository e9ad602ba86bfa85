"""The quantized formats' linear layers on the GPU against bf16, on Llama-3-8B's four decoder
weights (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) at the row counts of
decode steps: what `kernels.linear` runs for each format (the autotuned dequantizing GEMV at one
row, the dequantizing GEMM or `_scaled_mm` above) and for bf16 (our gemv / skinny_gemm, or
cuBLAS), beside each format's bytes floor.

Each call reads a different copy of the weight (copies enough to hold 4x the L2 cache), as a
decode step reads every weight from HBM; times are from a CUDA graph of those calls
(`common.graph_us`), after one eager call (which autotunes). The floor is the weight's bytes
(values, scales and zero points) plus x and y over the measured copy bandwidth. "step" sums the
four shapes times 32 layers: a decode step's linear layers, the part the formats change.

Columns per format: µs, then x floor and x bf16. ``fp8`` is W8A8 (`_scaled_mm` with the fused
activation quantization) from two rows on, the W8A16 GEMV at one; ``fp8 w8a16`` forces the
dequantizing kernels at every row count (`fp8_linear.W8A16_MAX_ROWS`); ``fp8 triton`` runs the W8A8
product on our autotuned FP8 GEMM instead of `_scaled_mm` (`fp8_linear.W8A8_GEMM`); ``quant`` is the
activation quantization kernel alone. "rel err" is each format's output against the product with
its dequantized weight (for fp8 from two rows on it includes the activations' FP8 rounding, ~2%).

At one row gate_up is also timed as the model runs it, fused with SiLU (`gemv_act_and_mul` for
bf16, `PackedWeight.act_and_mul` for the formats): the last table.

``--sweep`` also times, at one row, every tile the autotuner chooses from (`GEMV_TILES`) and the
dequantizing GEMM's tiles for 16 rows (the tensor cores at one row), and with ``--wide`` 40-odd more shapes of tile (4-32 rows a program, 64-256 stored bytes a thread a
step, with and without PREFETCH): what `GEMV_TILES` was cut from.

    python benchmarks/quantized_gemv.py [--rows 1,8,32,128] [--formats fp8,fp8-block,int4] [--sweep [--wide]]
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch
import triton

from common import graph_us, markdown_table, measure_copy_bandwidth, remove_script_dir_from_sys_path

remove_script_dir_from_sys_path()

from llmserve.kernels import dequant_linear as D  # noqa: E402
from llmserve.kernels.dequant_linear import dequant_linear_triton  # noqa: E402
from llmserve.kernels.fp8_linear import fp8_linear_w8a8, quantize_fp8_rows_triton  # noqa: E402
from llmserve.kernels.gemv import gemv_act_and_mul  # noqa: E402
from llmserve.kernels.quantized_linear import linear  # noqa: E402
from llmserve.quantization.config import quantize_fp8, quantize_fp8_blocks, quantize_int4  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
DEVICE = "cuda"
QUANTIZE = {"fp8": quantize_fp8, "fp8-block": quantize_fp8_blocks, "int4": quantize_int4}


def weight_bytes(w) -> int:
    return w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()


def copies_of(w, count: int) -> list:
    if isinstance(w, torch.Tensor):
        return [w] + [w.clone() for _ in range(count - 1)]
    return [w] + [w._map(torch.clone) for _ in range(count - 1)]


def rotating_us(fn, ws: list) -> float:
    turn = itertools.cycle(range(len(ws)))
    fn(ws[0])                       # compile and autotune outside the graph
    torch.cuda.synchronize(DEVICE)
    return graph_us(lambda: fn(ws[next(turn)]), calls=len(ws))


def wide_tiles(pack: int) -> list[triton.Config]:
    """More one-row tiles than `GEMV_TILES`: 64 to 256 stored bytes a thread a K step, either loop."""
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "PREFETCH": prefetch}, num_warps=w, num_stages=1)
            for n, k, w, prefetch in itertools.product((4, 8, 16, 32), (1024, 2048, 4096, 8192), (4, 8), (False, True))
            if 64 <= n * k // pack // (32 * w) <= 256]


def tile_name(c: triton.Config) -> str:
    if "BLOCK_M" in c.kwargs:
        return f"gemm {c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']}/{c.num_warps}w/{c.num_stages}s"
    return f"{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']}/{c.num_warps}w{'/pf' if c.kwargs.get('PREFETCH') else ''}"


def sweep_tiles(x: torch.Tensor, ws: list, wide: bool) -> dict[str, float]:
    """Microseconds of the one-row GEMV at each tile (`configs_for`'s, and with ``wide``
    `wide_tiles`' too), reading the weight copies ``ws`` in turn."""
    w, scale, _, block = ws[0]._gemv_operands()
    configs = D.configs_for(x, w, scale, block)
    K = x.shape[-1]
    if wide:
        template = configs[0].kwargs       # CV and EVEN_K as the prune derives them
        known = {tile_name(c) for c in configs}
        configs += [triton.Config({**template, **c.kwargs, "EVEN_K": K % c.kwargs["BLOCK_K"] == 0},
                                  num_warps=c.num_warps, num_stages=1)
                    for c in wide_tiles(D.kernel_layout(w, block)["PACK"])
                    if c.kwargs["BLOCK_K"] <= K and tile_name(c) not in known]
    # The tensor-core GEMM at one row (15 of its 16 rows masked): it dequantizes into bf16 for
    # the MMA, fewer instructions a value than the GEMV's float32 FMAs.
    configs += D._prune_gemm(D.GEMM_CONFIGS, {"K": K, "ROWS": 16}, **D.kernel_layout(w, block))
    times = {}
    for c in configs:
        try:
            times[tile_name(c)] = rotating_us(lambda q: dequant_linear_triton(x, *q._gemv_operands(), config=c), ws)
        except Exception as e:   # a tile past the registers or shared memory
            print(f"  {tile_name(c)}: {type(e).__name__}")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,128", help="comma-separated row counts")
    p.add_argument("--formats", default="fp8,fp8-block,int4", help=f"of {', '.join(QUANTIZE)}")
    p.add_argument("--sweep", action="store_true", help="also time every one-row tile the autotuner tries")
    p.add_argument("--wide", action="store_true", help="with --sweep: many more shapes of tile")
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    formats = args.formats.split(",")
    start = time.perf_counter()
    bw = measure_copy_bandwidth(DEVICE)
    l2 = getattr(torch.cuda.get_device_properties(DEVICE), "L2_cache_size", 50 << 20) or (50 << 20)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"L2 {l2 >> 20} MiB")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    table, step, fused, swept = [], {}, {}, []
    for name, (N, K) in SHAPES.items():
        dense = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16, generator=g) * K ** -0.5
        weights = {"bf16": dense} | {f: QUANTIZE[f](dense).to(dense.device, dense.dtype) for f in formats}
        copies = {f: copies_of(w, max(2, math.ceil(4 * l2 / weight_bytes(w)))) for f, w in weights.items()}
        for M in rows_list:
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=g)
            io = (M * K + M * N) * 2
            times, errs = {}, {}
            for f, ws in copies.items():
                times[f] = rotating_us(lambda w: linear(x, w), ws)
                if f != "bf16":
                    want = x.float() @ ws[0].dequantize(torch.float32).t()
                    errs[f] = ((linear(x, ws[0]).float() - want).norm() / want.norm()).item()
            if args.sweep and M == 1:
                for f in formats:
                    tiles = sweep_tiles(x, copies[f], args.wide)
                    best = min(tiles, key=tiles.get)
                    floor = (weight_bytes(weights[f]) + io) / bw * 1e6
                    swept.append([f, name, f"{times[f]:.1f}", f"{times[f] / floor:.2f}", f"{tiles[best]:.1f} {best}",
                                  f"{tiles[best] / floor:.2f}"])
                    print(f"  {f} {name}: " + ", ".join(f"{t} {us:.1f}" for t, us in sorted(tiles.items(), key=lambda kv: kv[1])))
            if name == "gate_up" and M == 1:
                for f, ws in copies.items():
                    us = rotating_us(lambda w: gemv_act_and_mul(x, w, "silu") if f == "bf16"
                                     else w.act_and_mul(x, "silu"), ws)
                    fused[f] = (us, us / ((weight_bytes(ws[0]) + (K + N // 2) * 2) / bw * 1e6))
            if "fp8" in copies:
                fp8 = copies["fp8"]
                times["fp8 w8a16"] = rotating_us(
                    lambda w: dequant_linear_triton(x, w.weight, w.weight_scale.view(-1, 1), None, (1, K)), fp8)
                times["quant"] = graph_us(lambda: quantize_fp8_rows_triton(x, None))
                times["fp8 triton"] = rotating_us(lambda w: fp8_linear_w8a8(x, w.weight, w.weight_scale, None, "triton"), fp8)
            row = [name, M, f"{times['bf16']:.1f}", f"{(weight_bytes(dense) + io) / bw * 1e6:.1f}"]
            for f in formats:
                floor = (weight_bytes(weights[f]) + io) / bw * 1e6
                row += [f"{times[f]:.1f}", f"{times[f] / floor:.2f}", f"{times[f] / times['bf16']:.2f}", f"{errs[f]:.1e}"]
            if "fp8" in copies:
                row += [f"{times['fp8 w8a16']:.1f}", f"{times['fp8 triton']:.1f}", f"{times['quant']:.1f}"]
            table.append(row)
            for f, t in times.items():
                step[f, M] = step.get((f, M), 0.0) + LAYERS * t
            for f in formats:
                step[f"{f} floor", M] = step.get((f"{f} floor", M), 0.0) + LAYERS * (weight_bytes(weights[f]) + io) / bw * 1e6
        del copies, weights, dense
        torch.cuda.empty_cache()
    headers = ["weight", "rows", "bf16 µs", "bf16 floor µs"]
    for f in formats:
        headers += [f"{f} µs", "x floor", "x bf16", "rel err"]
    if "fp8" in formats:
        headers += ["fp8 w8a16 µs", "fp8 triton µs", "quant µs"]
    print(markdown_table(headers, table))
    print("\nA decode step's 128 linear layers (4 shapes x 32 layers), ms:")
    srows = []
    for M in rows_list:
        line = [M, f"{step['bf16', M] / 1e3:.3f}"]
        for f in formats:
            line += [f"{step[f, M] / 1e3:.3f}", f"{step[f, M] / step[f'{f} floor', M]:.2f}", f"{step[f, M] / step['bf16', M]:.2f}"]
        if "fp8" in formats:
            line += [f"{step['fp8 w8a16', M] / 1e3:.3f}", f"{step['fp8 triton', M] / 1e3:.3f}"]
        srows.append(line)
    sh = ["rows", "bf16 ms"] + [h for f in formats for h in (f"{f} ms", "x floor", "x bf16")]
    print(markdown_table(sh + (["fp8 w8a16 ms", "fp8 triton ms"] if "fp8" in formats else []), srows))
    if fused:
        print("\ngate_up fused with SiLU at one row, µs (x floor: the weight's bytes over the copy bandwidth):")
        print(markdown_table(["format", "µs", "x floor"], [[f, f"{us:.1f}", f"{ratio:.2f}"] for f, (us, ratio) in fused.items()]))
    if swept:
        print("\nOne row: the autotuned tile against the sweep's best, µs (x floor):")
        print(markdown_table(["format", "weight", "autotuned µs", "x floor", "best tile µs", "x floor"], swept))
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
