"""Tensor-parallel scaling (issue 34): decode steps and serving at tp = 1, 2, 4 in one run.

What is measured, for each --tp value
  offline   the engine in this process (``engine.py``'s ``keep_in_flight``: the scheduler and the
            worker processes the server uses, without HTTP), greedy random prompts of
            --input-len tokens, exactly --output-len new tokens each: the mean TPOT at C=1 and
            C=32 (one request's time per decode step: at C=1 that is the step's time) and the
            output tok/s at C=128. A warm-up of C requests precedes each timed run.
  serving   ``llmserve serve --tp N`` started as a process, then ``serving.py`` at
            --max-concurrency 128 (4 x 128 requests, same lengths), its output tok/s.

At tp > 1 each runs once per --all-reduce mode: ``custom`` (the default at pp = 1: small all-reduces
over peer-to-peer buffers, common/custom_all_reduce.py, each layer's two fused with the residual add
and norm after them), ``unfused`` (the same without the fusion: ``LLMSERVE_FUSED_ALL_REDUCE=0``,
an all-reduce launch and an add_rmsnorm launch), ``one-way`` (the fused kernel's flagless protocol:
``LLMSERVE_FUSED_ALL_REDUCE=one-way``), ``one-way-push`` (that, with batch-1 o and down GEMVs
pushing their rows themselves) and ``nccl`` (``--disable-custom-all-reduce``; the only one
at pp > 1). With --pp (pipeline stages, a list like --tp) each tp runs at each pp:
the stages run one after another, so pp=2's step is pp=1's plus the hand-offs, not less.
Each row also gives the ratio to tp=1's number and the issue's goal (tp=2 step <= 0.6x at C=1,
<= 0.62x at C=32, tp=4 <= 0.36x; C=128 throughput at tp=2 >= 1.7x).

Run (GPUs):  python benchmarks/make_random_model.py --out /tmp/llama3-8b-random
             python benchmarks/tp_scaling.py --model /tmp/llama3-8b-random --tp 1,2,4 --json benchmarks/results/tp_scaling.json
Decode steps only, custom against NCCL (a few minutes):
             python benchmarks/tp_scaling.py --model /tmp/llama3-8b-random --tp 1,2 --concurrency 1,32 \
                 --output-len 64 --no-serving --cuda-graph-max-bs 32
A 70B shape at tp=4, no checkpoint written (random weights drawn at load):
             python benchmarks/make_random_model.py --shape 70b --config-only --out /tmp/llama3-70b-dummy
             python benchmarks/tp_scaling.py --model /tmp/llama3-70b-dummy --load-format dummy --tp 4 --concurrency 1 \
                 --no-serving --all-reduce custom,nccl
Pipeline stages against one GPU (2 GPUs; each stage replays graphs of its layers):
             python benchmarks/tp_scaling.py --model /tmp/llama3-8b-random --tp 1 --pp 1,2 --concurrency 1,32 \
                 --output-len 64 --no-serving --cuda-graph-max-bs 32
With HF transformers' tensor parallelism beside it (the peer reads the weight files):
             python benchmarks/tp_scaling.py --model /tmp/llama3-8b-random --tp 1,2,4 --concurrency 1,32 --output-len 64 \
                 --no-serving --peer hf
Smoke (CPU): python benchmarks/make_random_model.py --shape tiny --device cpu --out /tmp/tiny
             python benchmarks/tp_scaling.py --model /tmp/tiny --tp 1,2 --input-len 16 --output-len 8 --concurrency 1,2,4 --no-serving
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from common import environment, markdown_table, measure_copy_bandwidth, remove_script_dir_from_sys_path, write_json
from server_process import llmserve_server, serving_load
from engine import random_prompts, run_requests  # last: importing it takes this folder off sys.path

remove_script_dir_from_sys_path()

from llmserve.engine.config import EngineConfig, inspect_model, resolve_model_path  # noqa: E402
from llmserve.engine.engine import LLMEngine  # noqa: E402
from llmserve.tokenizer import load_tokenizer  # noqa: E402

GOALS = {(2, "tpot C=1"): ("<=", 0.6), (2, "tpot C=32"): ("<=", 0.62), (4, "tpot C=1"): ("<=", 0.36),
         (4, "tpot C=32"): ("<=", 0.36), (2, "offline tok/s C=128"): (">=", 1.7), (2, "serving tok/s C=128"): (">=", 1.7)}


@dataclass
class TpResult:
    tp: int
    all_reduce: str                  # custom | unfused | nccl ("" at tp=1)
    weight_bytes: int = 0            # the model's weights, all ranks' shares (WorkerInfo.weight_bytes)
    numbers: dict[str, float] = field(default_factory=dict)   # metric -> value
    pp: int = 1
    peer: str = ""                   # "" (ours) | HF eager | HF compiled (hf_tp_peer.py)

    @property
    def label(self) -> str:
        kind = self.peer or self.all_reduce
        label = f"{self.tp} ({kind})" if kind else str(self.tp)
        return label + (f", pp={self.pp}" if self.pp > 1 else "")


def offline(args: argparse.Namespace, tp: int, all_reduce: str, levels: list[int], pp: int = 1) -> TpResult:
    graphs = {} if args.cuda_graph_max_bs is None else {"cuda_graph_max_bs": args.cuda_graph_max_bs}
    config = EngineConfig(model=args.model, tp=tp, pp=pp, dtype=args.dtype, max_running_requests=max(levels),
                          max_total_token_num=args.max_total_token_num, custom_all_reduce=all_reduce != "nccl",
                          load_format=args.load_format, **graphs)
    engine = LLMEngine(config, inspect_model(config, load_tokenizer(resolve_model_path(args.model))))
    prompts = random_prompts(engine.info.vocab_size, args.input_len)
    print(engine.summary(), file=sys.stderr)
    result = TpResult(tp, all_reduce, engine.info.weight_bytes, pp=pp)
    numbers = result.numbers
    try:
        for c in levels:
            run_requests(engine, prompts(c), args.output_len, c)     # warm-up
            r = run_requests(engine, prompts(4 * c), args.output_len, c)
            numbers[f"tpot C={c}"] = r.tpot_ms
            numbers[f"offline tok/s C={c}"] = r.out_tok_per_s
            print(f"tp={tp} pp={pp} {all_reduce} C={c}: TPOT {r.tpot_ms:.2f} ms, {r.out_tok_per_s:.0f} tok/s", file=sys.stderr)
    finally:
        engine.shutdown()
    return result


PEER_LABELS = {"hf": "HF eager", "hf-compiled": "HF compiled"}


def hf_peer(args: argparse.Namespace, tp: int, levels: list[int], weight_bytes: int) -> TpResult:
    """HF transformers' own tensor parallelism at ``tp`` (``hf_tp_peer.py`` under torchrun, one
    process per GPU): its decode step at a batch of each C, on the same checkpoint."""
    from llmserve.engine.worker_client import free_tcp_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "hf.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
                        "--master-port", str(free_tcp_port()), str(Path(__file__).with_name("hf_tp_peer.py")),
                        "--model", args.model, "--batch-sizes", ",".join(map(str, levels)),
                        "--prompt-len", str(args.input_len), "--mode", args.peer, "--json", str(out)], check=True)
        tpot = json.loads(out.read_text())["tpot_ms"]
    print(f"tp={tp} {PEER_LABELS[args.peer]}: decode step {tpot} ms", file=sys.stderr)
    return TpResult(tp, "", weight_bytes, {f"tpot C={c}": tpot[str(c)] for c in levels}, peer=PEER_LABELS[args.peer])


def step_floor_ms(weight_bytes: int, tp: int, bandwidth: float) -> float:
    """The decode step's floor at one request: each rank reads its 1/tp of the weights (every
    weight the ranks hold, as the issue counts them) at the copy bandwidth GPU 0 measured."""
    return weight_bytes / tp / bandwidth * 1e3


def serving(args: argparse.Namespace, tp: int, all_reduce: str, concurrency: int, pp: int = 1) -> float:
    flags = ["--tp", str(tp), "--pp", str(pp), "--max-concurrent-requests", str(4 * concurrency),
             "--api-server-count", str(args.api_server_count), "--load-format", args.load_format] + (
                 ["--dtype", args.dtype] if args.dtype else [])
    if all_reduce == "nccl":
        flags += ["--disable-custom-all-reduce"]
    if args.cuda_graph_max_bs is not None:
        flags += ["--cuda-graph-max-bs", str(args.cuda_graph_max_bs)]
    with llmserve_server(args.model, 18000 + tp * pp, flags) as url:
        summary = serving_load(url, args.model, concurrency, 4 * concurrency, args.input_len, args.output_len)
    return summary["output_throughput"]


MODES = ("custom", "unfused", "one-way", "one-way-push", "nccl")


@contextlib.contextmanager
def all_reduce_mode(mode: str):
    """``unfused``: the custom all-reduce's fused kernel off, ``one-way``: its flagless protocol, for
    the engines and servers started inside (their worker processes inherit the environment)."""
    from llmserve.common.custom_all_reduce import FUSED_ENV_VAR

    before = os.environ.get(FUSED_ENV_VAR)
    if mode in ("unfused", "one-way", "one-way-push"):
        os.environ[FUSED_ENV_VAR] = "0" if mode == "unfused" else mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FUSED_ENV_VAR, None)
        else:
            os.environ[FUSED_ENV_VAR] = before


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF directory (benchmarks/make_random_model.py writes one)")
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--pp", default="1", help="pipeline stages, each tp value at each of these (default: 1)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", default="1,32,128", help="offline C values (default: 1,32,128)")
    p.add_argument("--serving-concurrency", type=int, default=128)
    p.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP processes of the serving runs' servers (llmserve serve --api-server-count; default: 1)")
    p.add_argument("--no-serving", action="store_true", help="offline numbers only")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-total-token-num", type=int, default=None)
    p.add_argument("--all-reduce", default="custom,nccl",
                   help="at tp > 1, run once per mode: custom (the default: peer-to-peer kernels for small "
                        "messages, fused with the residual add and norm), unfused (custom without the fusion), "
                        "one-way (the fused kernel's flagless protocol), one-way-push (that, batch-1 GEMVs "
                        "pushing their rows), nccl (default: custom,nccl)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="decode graphs up to this batch (default: the engine's); smaller starts faster")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights drawn at load from --model's config.json (make_random_model.py "
                        "--config-only), as llmserve serve --load-format dummy (default: auto)")
    p.add_argument("--peer", choices=list(PEER_LABELS), default=None,
                   help="also time HF transformers' tensor parallelism at each --tp (hf_tp_peer.py: "
                        "from_pretrained(tp_plan='auto') under torchrun), its decode step at a batch of each "
                        "--concurrency; it reads --model's weight files (not with --load-format dummy)")
    p.add_argument("--json", default=None)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    tps = [int(t) for t in args.tp.split(",")]
    pps = [int(p) for p in args.pp.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.all_reduce.split(",")
    if not set(modes) <= set(MODES):
        raise SystemExit(f"--all-reduce takes {', '.join(MODES)}, got {args.all_reduce!r}")
    if args.peer and args.load_format == "dummy":
        raise SystemExit("--peer loads --model's weight files: write them with make_random_model.py (the weights "
                         "--load-format dummy draws) and run without --load-format dummy")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bandwidth = measure_copy_bandwidth(device)
    results = []
    for tp in tps:
        for pp in pps:
            # The custom all-reduce is refused at pp > 1 (engine/config.py, check_pipeline).
            for all_reduce in ([m for m in modes if pp == 1 or m == "nccl"] or ["nccl"]) if tp > 1 else [""]:
                with all_reduce_mode(all_reduce):
                    result = offline(args, tp, all_reduce, levels, pp)
                    if not args.no_serving:
                        result.numbers[f"serving tok/s C={args.serving_concurrency}"] = serving(
                            args, tp, all_reduce, args.serving_concurrency, pp)
                results.append(result)
    if args.peer:
        results += [hf_peer(args, tp, levels, results[0].weight_bytes) for tp in tps]
    # Each row against the first of its runner's (ours, the peer's).
    bases = {}
    for r in results:
        bases.setdefault(r.peer, r.numbers)
    metrics = list(results[0].numbers)
    rows = []
    for r in results:
        for m in (m for m in metrics if m in r.numbers):
            base = bases[r.peer]
            ratio = r.numbers[m] / base[m] if base[m] else float("nan")
            goal = GOALS.get((r.tp, m)) if r.pp == 1 and not r.peer else None
            verdict = "" if goal is None else f"{goal[0]} {goal[1]}: " + (
                "met" if (ratio <= goal[1] if goal[0] == "<=" else ratio >= goal[1]) else "MISSED")
            floor = step_floor_ms(r.weight_bytes, r.tp, bandwidth) if m == "tpot C=1" else None
            rows.append([r.label, m, f"{r.numbers[m]:.2f}", f"{ratio:.3f}", "" if floor is None else f"{floor:.2f}",
                         "" if floor is None else f"{r.numbers[m] / floor:.2f}", verdict])
    print(f"\n### Tensor-parallel scaling, in {args.input_len} / out {args.output_len}, serving with "
          f"{args.api_server_count} HTTP process(es)\n")
    print(markdown_table(["tp", "metric", "value", f"/ tp={tps[0]} (same runner)", "floor ms", "x floor", "goal"], rows))
    if args.json:
        write_json(args.json, {"benchmark": "tp_scaling", "environment": environment(device), "model": args.model,
                               "input_len": args.input_len, "output_len": args.output_len,
                               "api_server_count": args.api_server_count,
                               "copy_bandwidth_bytes_per_s": bandwidth,
                               "load_format": args.load_format,
                               "step_floor_ms_c1": {r.label: step_floor_ms(r.weight_bytes, r.tp, bandwidth) for r in results},
                               "results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
