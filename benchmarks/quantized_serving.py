"""Serving throughput by weight and KV format (issue 32): ``llmserve serve`` with bf16 weights,
then FP8 weights (``--quantization fp8``), then FP8 weights and an FP8 KV cache
(``--kv-cache-dtype fp8``), each under ``serving.py`` at one concurrency (default C = 128, in 512 /
out 128, 4 x C timed requests after C warm-up), one server at a time on the same GPU.

Columns: each format's weight bytes and KV-cache tokens (the server's /info), its output tok/s and
that over the first format's (issue 32's target: FP8 weights and KV >= 1.3x bf16 at C = 128), TPOT
p50, and a ceiling: C requests decoding at the floor of their step, ``C / ((weight bytes + C x
(in + out / 2) x KV bytes a token) / copy bandwidth)`` out tok/s. It leaves out the prefills (each
request's 512 tokens), so it is an upper bound, not a target.

Run (GPU): python benchmarks/make_random_model.py --shape 8b --config-only --out /tmp/m8b \
               --tokenizer .gpu-assets/smollm2-tokenizer
           python benchmarks/quantized_serving.py --model /tmp/m8b --load-format dummy --json out.json
Smoke (CPU): python benchmarks/make_random_model.py --shape tiny --device cpu --out /tmp/tiny
           python benchmarks/quantized_serving.py --model /tmp/tiny --concurrency 4 --input-len 32 --output-len 8
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx

from common import environment, markdown_table, measure_copy_bandwidth, remove_script_dir_from_sys_path, write_json
from server_process import llmserve_server, serving_load

remove_script_dir_from_sys_path()

import torch  # noqa: E402

from llmserve.common.basemodel.model_shape import head_dim, num_kv_heads  # noqa: E402
from llmserve.common import mem_manager  # noqa: E402

# name -> llmserve serve's flags for it
FORMATS = {
    "bf16": [],
    "fp8": ["--quantization", "fp8"],
    "fp8+kv": ["--quantization", "fp8", "--kv-cache-dtype", "fp8"],
}
# An element of the KV cache, by the start of /info's kv_cache_dtype ("fp8_e4m3 (its scales)"; else 2 bytes)
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "float32": torch.float32}


@dataclass
class FormatResult:
    name: str
    flags: list[str]
    weight_bytes: int
    kv_cache_tokens: int
    kv_cache_dtype: str
    out_tok_per_s: float
    tpot_p50_ms: float
    ceiling_tok_per_s: float


def kv_bytes_per_token(model: str, kv_dtype: str) -> int:
    """K and V of every layer for one token (as the server sizes its pool), from the checkpoint's config.json."""
    config = SimpleNamespace(**json.loads(Path(model, "config.json").read_text()))
    dtype = next((t for key, t in KV_DTYPES.items() if kv_dtype.startswith(key)), torch.bfloat16)
    return mem_manager.kv_bytes_per_token(config.num_hidden_layers, num_kv_heads(config), head_dim(config), dtype)


def run_format(args: argparse.Namespace, name: str, bandwidth: float, port: int) -> FormatResult:
    flags = [*FORMATS[name], "--load-format", args.load_format, "--max-concurrent-requests", str(4 * args.concurrency)]
    with llmserve_server(args.model, port, flags) as url:
        info = httpx.get(f"{url}/info", timeout=30).json()
        summary = serving_load(url, args.model, args.concurrency, 4 * args.concurrency, args.input_len, args.output_len,
                               "--warmup", str(args.concurrency))
    kv_dtype = str(info.get("kv_cache_dtype") or "")
    context = args.input_len + args.output_len / 2      # the mean tokens a decode step attends to
    step_bytes = info["weight_bytes"] + args.concurrency * context * kv_bytes_per_token(args.model, kv_dtype)
    result = FormatResult(name, flags, info["weight_bytes"], info["kv_cache_tokens"], kv_dtype,
                          summary["output_throughput"], summary["tpot_ms"]["p50"],
                          args.concurrency / (step_bytes / bandwidth))
    print(f"{name}: {result.out_tok_per_s:.0f} out tok/s, weights {result.weight_bytes / 1e9:.2f} GB, "
          f"KV {result.kv_cache_tokens} tokens ({kv_dtype})", file=sys.stderr)
    return result


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF directory (make_random_model.py writes one)")
    p.add_argument("--formats", default="bf16,fp8,fp8+kv", help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights drawn at load from config.json alone (llmserve serve's flag)")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=18200)
    p.add_argument("--json", default=None)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    names = args.formats.split(",")
    unknown = set(names) - set(FORMATS)
    if unknown:
        raise SystemExit(f"unknown --formats {sorted(unknown)}: choose from {', '.join(FORMATS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bandwidth = measure_copy_bandwidth(device)
    results = [run_format(args, name, bandwidth, args.port + i) for i, name in enumerate(names)]
    base = results[0].out_tok_per_s
    rows = [[r.name, " ".join(FORMATS[r.name]) or "(none)", f"{r.weight_bytes / 1e9:.2f}", r.kv_cache_tokens,
             f"{r.out_tok_per_s:.0f}", f"{r.out_tok_per_s / base:.3f}", f"{r.tpot_p50_ms:.2f}",
             f"{r.ceiling_tok_per_s:.0f}", f"{r.out_tok_per_s / r.ceiling_tok_per_s:.2f}"] for r in results]
    print(f"\n### Serving by format, C={args.concurrency}, in {args.input_len} / out {args.output_len}\n")
    print(markdown_table(["format", "flags", "weights GB", "KV tokens", "out tok/s", f"/ {results[0].name}",
                          "TPOT p50 ms", "ceiling tok/s", "of ceiling"], rows))
    if args.json:
        write_json(args.json, {"benchmark": "quantized_serving", "environment": environment(device),
                               "model": args.model,
                               "load_format": args.load_format, "concurrency": args.concurrency,
                               "input_len": args.input_len, "output_len": args.output_len,
                               "copy_bandwidth_bytes_per_s": bandwidth, "results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
