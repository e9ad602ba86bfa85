"""How many KV-cache tokens the server's start-up sizing gives a model, per ``--kv-cache-dtype``:
the pool is sized from the memory the weights leave (``--mem-fraction`` 0.85, as ``llmserve
serve``), so a float8 cache should hold twice a bf16 one's tokens in the same bytes.

Run (GPU):   python benchmarks/kv_cache_tokens.py --model-size 8b
Smoke (CPU): python benchmarks/kv_cache_tokens.py --device cpu --model-size tiny
             (the CPU's default pool: 16384 tokens at the model's dtype's bytes)
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from common import add_device_arguments, dtype_name, markdown_table, remove_script_dir_from_sys_path, resolve_dtype
from offline import CONFIGS, random_hf_weights

remove_script_dir_from_sys_path()

from llmserve.common.basemodel import ModelInitParams  # noqa: E402  (after the sys.path fix above)
from llmserve.models.registry import get_model_class  # noqa: E402
from llmserve.quantization import KV_CACHE_DTYPES  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-size", choices=sorted(CONFIGS), default="8b")
    p.add_argument("--kv-cache-dtypes", default="auto,fp8", help="comma-separated (default: auto,fp8)")
    add_device_arguments(p)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cfg = CONFIGS[args.model_size]
    rows = []
    for kv in args.kv_cache_dtypes.split(","):
        if kv not in KV_CACHE_DTYPES:
            raise SystemExit(f"--kv-cache-dtypes: {kv!r} is not one of {KV_CACHE_DTYPES}")
        model = get_model_class(cfg["model_type"])(ModelInitParams(
            model_path="", device=str(device), dtype=dtype, config=cfg, weights=random_hf_weights(cfg, device, dtype),
            kv_cache_dtype=kv))
        pool = sum(t.nbytes for t in model.mem_manager.kv_buffer)
        rows.append([kv, model.kv_cache_description, model.max_total_token_num, f"{pool / 2**30:.2f}"])
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n### KV-cache tokens, {args.model_size} shapes, {dtype_name(dtype)} weights\n")
    print(markdown_table(["--kv-cache-dtype", "cache", "tokens", "pool GiB"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
