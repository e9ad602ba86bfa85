"""Time to first token of a long prompt, cold and served from the prefix cache.

What is measured
  One ``--input-len``-token prompt (random tokens) through the offline ``LLM``, one generated
  token (so the time is the prefill's plus one sample): first on an empty cache (cold), then the
  same prompt again (repeat: all but its last token come from the cache), then the prompt's first
  ``--input-len - --suffix-len`` tokens with a new suffix (shared prefix: the suffix is
  prefilled). Each is the median of ``--repeats`` runs; before every cold run the cache is
  emptied (``LLM.reset_prefix_cache``). ``--no-prefix-cache`` runs the same with the cache off.

Run (CPU, the embedded model):  python benchmarks/prefix_cache.py
Run (GPU):                      python benchmarks/prefix_cache.py --model /tmp/llama3-8b-random
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import environment, markdown_table, remove_script_dir_from_sys_path, write_json

remove_script_dir_from_sys_path()

from llmserve import LLM, SamplingParams  # noqa: E402  (after the sys.path fix above)


def ttft_ms(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Milliseconds to the first token, and the prompt tokens the cache served."""
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    (out,) = llm.generate([prompt], params)
    return (time.perf_counter() - started) * 1e3, out.num_cached_tokens or 0


def measure(llm: LLM, input_len: int, suffix_len: int, repeats: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    vocab = llm.engine.info.vocab_size
    rows: dict[str, list[tuple[float, int]]] = {"cold": [], "repeat": [], "shared prefix": []}
    for _ in range(repeats):
        prompt = [rng.randrange(vocab) for _ in range(input_len)]
        llm.reset_prefix_cache()
        rows["cold"].append(ttft_ms(llm, prompt))
        rows["repeat"].append(ttft_ms(llm, prompt))
        suffix = [rng.randrange(vocab) for _ in range(suffix_len)]
        rows["shared prefix"].append(ttft_ms(llm, prompt[: input_len - suffix_len] + suffix))
    cold = statistics.median(ms for ms, _ in rows["cold"])
    return [{"run": name, "ttft_ms": round(statistics.median(ms for ms, _ in runs), 1),
             "cached_tokens": statistics.median(n for _, n in runs),
             "speed_up": round(cold / statistics.median(ms for ms, _ in runs), 1)} for name, runs in rows.items()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--input-len", type=int, default=2000)
    p.add_argument("--suffix-len", type=int, default=200, help="new tokens after the shared prefix (default: 200)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false")
    p.add_argument("--json", default=None, help="also write every number here")
    args = p.parse_args()
    with LLM(args.model, dtype=args.dtype, prefix_cache=args.prefix_cache) as llm:
        ttft_ms(llm, [1, 2, 3])    # warm-up: the first step pays one-off costs
        rows = measure(llm, args.input_len, args.suffix_len, args.repeats, args.seed)
        print(f"# {llm.engine.summary()[2:]}, prefix cache {'on' if args.prefix_cache else 'off'}, "
              f"{args.input_len}-token prompt, median of {args.repeats}")
    print(markdown_table(list(rows[0]), [list(r.values()) for r in rows]))
    if args.json:
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        write_json(args.json, {"environment": environment(device), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
