"""Tokens per second of ``LLM.generate`` against HF transformers' ``generate`` on the same GGUF
file dequantized to float32, on the CPU, greedy, batch 1 and 8.

Each side runs in its own process (this script starts both), so neither finds the other's
threads or memory in its way. Ours runs the file as ``llmserve`` does (on CPU its Q4_0/Q4_1/Q8_0
matrices in their blocks; ``--dequantize`` for dense float32).

Run: python benchmarks/cpu_generate.py [--model FILE.gguf] [--new-tokens 128] [--dequantize]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS = ["The history of Rome", "Once upon a time", "import numpy as np\n", "Dear Sir,",
           "The capital of France", "In 1905, Einstein", "def fib(n):", "Recipe: pancakes"]
BATCHES = (1, 8)


def run_ours(model: str, new_tokens: int, dequantize: bool) -> dict[int, float]:
    from llmserve import LLM, SamplingParams

    rates = {}
    with LLM(model=model, dequantize=dequantize) as llm:
        for b in BATCHES:
            llm.generate(PROMPTS[:b], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))  # warm-up
            t = time.perf_counter()
            llm.generate(PROMPTS[:b], SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True))
            rates[b] = b * new_tokens / (time.perf_counter() - t)
    return rates


def run_hf(model: str, new_tokens: int) -> dict[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from llmserve.tokenizer import load_tokenizer

    directory, name = os.path.split(os.path.abspath(model))
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tok = load_tokenizer(model)
    tok.padding_side = "left"
    rates = {}
    for b in BATCHES:
        enc = tok(PROMPTS[:b], return_tensors="pt", padding=True)
        with torch.inference_mode():
            for n in (8, new_tokens):          # warm-up, then timed
                t = time.perf_counter()
                hf.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
                rates[b] = b * n / (time.perf_counter() - t)
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dequantize", action="store_true", help="ours with dense float32 matrices")
    p.add_argument("--side", choices=["ours", "hf"], help=argparse.SUPPRESS)   # the child processes
    args = p.parse_args()
    if args.model is None:
        from llmserve.default_model import default_model_path

        args.model = default_model_path()
    if args.side:
        rates = run_ours(args.model, args.new_tokens, args.dequantize) if args.side == "ours" else run_hf(args.model, args.new_tokens)
        print(json.dumps(rates))
        return 0
    results = {}
    for side in ("ours", "hf"):
        cmd = [sys.executable, __file__, "--side", side, "--model", args.model, "--new-tokens", str(args.new_tokens)]
        out = subprocess.run(cmd + (["--dequantize"] if args.dequantize else []), capture_output=True, text=True, check=True)
        results[side] = {int(b): r for b, r in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    print(f"\n### LLM.generate vs HF generate, {os.path.basename(args.model)}, greedy, {args.new_tokens} new tokens\n")
    print("| batch | ours tok/s | HF tok/s | ours / HF |\n|--:|--:|--:|--:|")
    for b in BATCHES:
        print(f"| {b} | {results['ours'][b]:.1f} | {results['hf'][b]:.1f} | {results['ours'][b] / results['hf'][b]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
