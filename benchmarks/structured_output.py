"""Structured output at full speed: throughput with a JSON schema on every request against the
same requests unconstrained, in one run (issue 15's goal: >= 0.9x at batch 32); and the schema
compile time.

What is measured
  The offline engine (``LLMEngine``, no HTTP: the scheduler and worker processes the server
  uses), as ``engine.py`` drives it: C requests in flight (a new one joins as one finishes),
  ``--input-len`` random prompt tokens, exactly ``--output-len`` generated tokens each:
    unconstrained  ``ignore_eos``, so every request runs to its length;
    json-schema    every request constrained by a schema whose language is longer than
                   ``--output-len`` tokens (an array of at least 10,000 records), so every
                   request also runs to its length: the same tokens, now each through the
                   grammar's mask. ``--schemas distinct`` (default) gives every request a schema
                   of its own (an extra property named after it), so each compiles on arrival;
                   ``same`` shares one (compiled once, cached).
  Both run greedy (``--temperature 0``, as engine.py) or sampled, in the engine's own step loop
  (overlapped on one GPU; ``--loops plain,overlap`` for both).

  Compile time: ``--compile-schemas`` random schemas (objects, arrays, enums, nested, $ref,
  formats; benchmarks/grammar_libraries.py's generator) at this model's vocabulary, each timed
  from its text to its first token mask (the work the worker does when a new schema arrives), and
  the edge check the HTTP process does (``check_guided_decoding``, no tokenizer), p50 / p99.

Run (GPU):   python benchmarks/make_random_model.py --out /data/llama3-8b-random
             python benchmarks/structured_output.py --model /data/llama3-8b-random --concurrency 32 --num-prompts 128
Run (CPU):   python benchmarks/structured_output.py            (the embedded SmolLM2, C=32)
Smoke (CPU): python benchmarks/structured_output.py --concurrency 2 --input-len 16 --output-len 4 --compile-schemas 5
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

from common import environment, markdown_table, remove_script_dir_from_sys_path, write_json
from grammar_libraries import pctl, random_schema, with_ref
from engine import Result, keep_in_flight, loops_to_time, random_prompts, result_of, start_engine  # last: importing it takes this folder off sys.path

remove_script_dir_from_sys_path()

import torch  # noqa: E402

from llmserve.engine.engine import LLMEngine  # noqa: E402
from llmserve.grammar import GrammarCompiler, check_guided_decoding, tokenizer_json  # noqa: E402
from llmserve.sampling_params import GuidedDecodingParams, SamplingParams  # noqa: E402
from llmserve.tokenizer import eos_token_ids, load_tokenizer  # noqa: E402


def long_schema(tag: str) -> dict:
    """Records of a few fields, at least 10,000 of them: no request finishes it within its tokens.
    ``tag`` names an extra property, so that distinct tags are distinct schemas."""
    record = {"type": "object", "additionalProperties": False, "required": ["id", "name", "kind", "score"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                             "name": {"type": "string", "maxLength": 24},
                             "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
                             "score": {"type": "integer", "minimum": -1000, "maximum": 1000}}}
    return {"type": "object", "additionalProperties": False, "required": [tag, "records"],
            "properties": {tag: {"type": "boolean"}, "records": {"type": "array", "items": record, "minItems": 10000}}}


@dataclass
class ModeResult:
    mode: str                        # unconstrained | json-schema
    result: Result                   # engine.py's numbers of the run


def run_requests(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], concurrency: int,
                 mode: str) -> ModeResult:
    """Keep ``concurrency`` requests in flight until each prompt has its tokens."""
    run = keep_in_flight(engine, list(zip(prompts, params)), concurrency)
    errors = [r.error for r in run.done if r.error]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return ModeResult(mode, result_of(engine, run, concurrency))


def compile_times(model_path: str, vocab_size: int, n: int) -> dict[str, list[float]]:
    """Seconds per schema: the edge check, and schema text -> first mask at this vocabulary."""
    import numpy as np

    tokenizer = load_tokenizer(model_path)
    compiler = GrammarCompiler(lambda: tokenizer_json(tokenizer), vocab_size, eos_token_ids(model_path, tokenizer))
    compiler.tokenizer    # built once per worker, at its first constrained request: not a compile
    rng = random.Random(1)
    mask = np.zeros(compiler.mask_words, dtype=np.int32)
    edge, first_mask = [], []
    for i in range(n):
        schema = random_schema(rng)
        schema = with_ref(schema) if i % 3 == 0 else {"type": "object", "properties": {"answer": schema},
                                                      "required": ["answer"]}
        params = GuidedDecodingParams(json=json.dumps(schema))
        t0 = time.perf_counter()
        check_guided_decoding(params)
        t1 = time.perf_counter()
        compiler.matcher(params).unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        t2 = time.perf_counter()
        edge.append(t1 - t0)
        first_mask.append(t2 - t1)
    return {"edge_check": edge, "first_mask": first_mask}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=None, help="timed requests per mode (default: 2C)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--schemas", choices=["distinct", "same"], default="distinct")
    p.add_argument("--loops", default=None, help="comma-separated: overlap, plain (default: the engine's choice)")
    p.add_argument("--rounds", type=int, default=1,
                   help="timed runs of each mode, alternated; the table keeps each mode's best (for a shared host)")
    p.add_argument("--compile-schemas", type=int, default=100)
    p.add_argument("--max-total-token-num", type=int, default=None)
    p.add_argument("--json", default=None, help="also write every number here")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    c = args.concurrency
    n = args.num_prompts or 2 * c
    engine = start_engine(args, c)
    vocab = engine.info.vocab_size
    prompts = random_prompts(vocab, args.input_len)

    serial = iter(range(10**9))

    def params(mode: str, count: int) -> list[SamplingParams]:
        base = dict(max_new_tokens=args.output_len, temperature=args.temperature, seed=0)
        if mode == "unconstrained":
            return [SamplingParams(ignore_eos=True, **base) for _ in range(count)]
        tags = [f"request_{next(serial)}" if args.schemas == "distinct" else "request" for _ in range(count)]
        return [SamplingParams(guided_decoding=GuidedDecodingParams(json=json.dumps(long_schema(t))), **base) for t in tags]

    print(f"{engine.summary()}; in {args.input_len} / out {args.output_len}, C={c}, {n} requests", file=sys.stderr)
    results = []
    try:
        for loop in loops_to_time(args.loops, engine):
            engine.overlap = loop == "overlap"
            for mode in ["unconstrained", "json-schema"]:
                run_requests(engine, prompts(c), params(mode, c), c, mode)   # warm-up
            best: dict[str, ModeResult] = {}
            for round_ in range(args.rounds):       # alternated, so that a busy spell hits both
                for mode in ["unconstrained", "json-schema"]:
                    r = run_requests(engine, prompts(n), params(mode, n), c, mode)
                    print(f"{loop} {mode} round {round_}: {r.result.out_tok_per_s:.1f} tok/s", file=sys.stderr)
                    if mode not in best or r.result.out_tok_per_s > best[mode].result.out_tok_per_s:
                        best[mode] = r
            results += best.values()
    finally:
        engine.shutdown()
    times = compile_times(engine.model_path, vocab, args.compile_schemas)

    print(f"\n### Structured output, offline engine, in {args.input_len} / out {args.output_len}, C={c}, "
          f"{engine.info.dtype} on {engine.info.device}, vocab {vocab}, schemas {args.schemas}\n")
    base = {m.result.loop: m.result.out_tok_per_s for m in results if m.mode == "unconstrained"}
    print(markdown_table(["loop", "mode", "requests", "out tok/s", "TPOT ms", "vs unconstrained"],
                        [[r.loop, m.mode, r.num_requests, f"{r.out_tok_per_s:.1f}", f"{r.tpot_ms:.2f}",
                          f"{r.out_tok_per_s / base[r.loop]:.3f}x"] for m in results for r in [m.result]]))
    print(f"\n### Schema compile time, {args.compile_schemas} random schemas, vocab {vocab}\n")
    print(markdown_table(["step", "p50 ms", "p99 ms", "max ms"],
                        [[name, f"{pctl(v, .5) * 1e3:.2f}", f"{pctl(v, .99) * 1e3:.2f}", f"{max(v) * 1e3:.2f}"]
                         for name, v in [("edge check (HTTP process)", times["edge_check"]),
                                         ("compile + first mask (worker)", times["first_mask"])]]))
    if args.json:
        write_json(args.json, {"benchmark": "structured_output", "environment": environment(torch.device(engine.info.device)),
                               "model": engine.model_path, "args": vars(args), "results": [asdict(m) for m in results],
                               "compile_seconds": times})
    return 0


if __name__ == "__main__":
    sys.exit(main())
