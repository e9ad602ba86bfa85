"""The offline engine under the serving benchmark's load: what the server should reach.

What is measured
  ``serving.py --max-concurrency C`` keeps C requests in flight against a server. This script
  sends the same kind of requests (``--input-len`` random prompt tokens, exactly
  ``--output-len`` generated tokens, greedy) straight to an ``LLMEngine`` in this process —
  the scheduler and worker processes the server uses, without HTTP — and keeps C of them in
  flight the same way: a new request joins as soon as one finishes. For each C it first runs
  C requests untimed (warm-up), then times ``--num-prompts`` (default 4C) of them.

Columns
  out tok/s   generated tokens / wall time of the timed requests
  TPOT ms     per request, (last token time - first token time) / (output tokens - 1), mean
  TTFT ms     per request, first token time - time it was queued, mean

The server's throughput at the same C, divided by this, is the share of the engine's
throughput that HTTP, tokenization and streaming leave (issue 10's goal: >= 90%).

Run (GPU):  python benchmarks/make_random_model.py /tmp/llama3-8b-random
            python benchmarks/engine.py --model /tmp/llama3-8b-random --concurrency 1,32,128,256
            python benchmarks/make_random_model.py --shape mixtral-8x7b --out /tmp/mixtral-8x7b-random
            python benchmarks/engine.py --model /tmp/mixtral-8x7b-random --tp 2 --concurrency 1,32
Smoke (CPU): python benchmarks/engine.py --concurrency 1,2 --input-len 16 --output-len 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from common import environment, markdown_table, remove_script_dir_from_sys_path, write_json

remove_script_dir_from_sys_path()

import torch  # noqa: E402

from llmserve.engine.config import EngineConfig, inspect_model, resolve_model_path  # noqa: E402  (after the sys.path fix above)
from llmserve.engine.engine import LLMEngine  # noqa: E402
from llmserve.engine.request import Request  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402
from llmserve.tokenizer import load_tokenizer  # noqa: E402


@dataclass
class Result:
    loop: str                        # overlap | plain: the engine's step loop (EngineConfig.overlap)
    concurrency: int
    num_requests: int
    output_tokens: int
    seconds: float
    out_tok_per_s: float
    tpot_ms: float
    ttft_ms: float


@dataclass
class Run:
    """The requests of one ``keep_in_flight``, and when each got its first and last token."""
    done: list[Request]
    first_token: dict[int, float]
    last_token: dict[int, float]
    start: float
    seconds: float

    def tpots_ms(self) -> list[float]:
        return [(self.last_token[r.req_id] - self.first_token[r.req_id]) / (r.num_output_tokens - 1) * 1e3
                for r in self.done if r.num_output_tokens > 1]


def keep_in_flight(engine: LLMEngine, jobs: list[tuple[list[int], SamplingParams]], concurrency: int) -> Run:
    """Keep ``concurrency`` of the (prompt, params) jobs in flight until every one has finished."""
    queue = list(jobs)
    running: list[Request] = []
    done: list[Request] = []
    first_token: dict[int, float] = {}
    last_token: dict[int, float] = {}
    start = time.perf_counter()
    while queue or running:
        while queue and len(running) < concurrency:
            running.append(engine.add_request(*queue.pop()))
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            first_token.setdefault(delta.req_id, now)
            last_token[delta.req_id] = now
        still = [r for r in running if not r.is_finished]
        done += [r for r in running if r.is_finished]
        running = still
    seconds = time.perf_counter() - start
    engine.flush()
    return Run(done, first_token, last_token, start, seconds)


def run_requests(engine: LLMEngine, prompts: list[list[int]], output_len: int, concurrency: int) -> Result:
    """Keep ``concurrency`` requests in flight until every prompt has its ``output_len`` tokens."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    return result_of(engine, keep_in_flight(engine, [(p, params) for p in prompts], concurrency), concurrency)


def result_of(engine: LLMEngine, run: Run, concurrency: int) -> Result:
    """A run's numbers."""
    done, first_token, start, seconds = run.done, run.first_token, run.start, run.seconds
    tokens = sum(r.num_output_tokens for r in done)
    tpots = run.tpots_ms()
    # the first C requests are all queued at the start: their TTFT is first token - start
    first_wave = sorted(done, key=lambda r: r.req_id)[:concurrency]
    ttfts = [(first_token[r.req_id] - start) * 1e3 for r in first_wave]
    return Result("overlap" if engine.overlap else "plain", concurrency, len(done), tokens, seconds, tokens / seconds,
                  statistics.fmean(tpots) if tpots else float("nan"), statistics.fmean(ttfts))


def start_engine(args: argparse.Namespace, max_running_requests: int) -> LLMEngine:
    """The offline engine on ``--model`` / ``--dtype`` / ``--max-total-token-num`` (this script's
    and structured_output.py's flags)."""
    config = EngineConfig(model=args.model, dtype=args.dtype, max_running_requests=max_running_requests,
                          max_total_token_num=args.max_total_token_num, tp=args.tp)
    return LLMEngine(config, inspect_model(config, load_tokenizer(resolve_model_path(args.model))))


def random_prompts(vocab_size: int, length: int) -> Callable[[int], list[list[int]]]:
    """A maker of n prompts of random token ids, the same sequence of them on every run."""
    rng = random.Random(0)
    return lambda n: [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(n)]


def loops_to_time(loops: str | None, engine: LLMEngine) -> list[str]:
    """``--loops`` as a list, by default the step loop the engine chose for itself."""
    return loops.split(",") if loops else ["overlap" if engine.overlap else "plain"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one GPU each (Mixtral-8x7B: 2)")
    p.add_argument("--concurrency", default="1,32,128", help="comma-separated C values (default: 1,32,128)")
    p.add_argument("--num-prompts", default=None,
                   help="timed requests per C: one number, or one per --concurrency value, comma-separated (default: 4C)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-total-token-num", type=int, default=None)
    p.add_argument("--loops", default=None,
                   help="comma-separated step loops to time, each over every C: overlap, plain "
                        "(default: the engine's own choice, overlap on one GPU)")
    p.add_argument("--json", default=None, help="also write every number here")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    counts = [int(n) for n in args.num_prompts.split(",")] if args.num_prompts else [4 * c for c in levels]
    if len(counts) == 1:
        counts *= len(levels)
    if len(counts) != len(levels):
        raise SystemExit("--num-prompts: one number, or one per --concurrency value")
    engine = start_engine(args, max(levels))
    prompts = random_prompts(engine.info.vocab_size, args.input_len)
    print(f"{engine.summary()}; in {args.input_len} / out {args.output_len}", file=sys.stderr)
    results = []
    try:
        for loop in loops_to_time(args.loops, engine):
            engine.overlap = loop == "overlap"
            for c, n in zip(levels, counts):
                run_requests(engine, prompts(c), args.output_len, c)          # warm-up
                results.append(run_requests(engine, prompts(n), args.output_len, c))
                print(f"{loop} C={c}: {results[-1].out_tok_per_s:.0f} tok/s", file=sys.stderr)
    finally:
        engine.shutdown()

    print(f"\n### Offline engine, in {args.input_len} / out {args.output_len}, {engine.info.dtype} on {engine.info.device}\n")
    print(markdown_table(["loop", "C", "requests", "out tok/s", "TPOT ms", "TTFT ms (first C)"],
                        [[r.loop, r.concurrency, r.num_requests, f"{r.out_tok_per_s:.1f}", f"{r.tpot_ms:.2f}", f"{r.ttft_ms:.1f}"]
                         for r in results]))
    if args.json:
        device = torch.device(engine.info.device)
        write_json(args.json, {"benchmark": "engine", "environment": environment(device), "model": engine.model_path,
                               "input_len": args.input_len, "output_len": args.output_len,
                               "results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
