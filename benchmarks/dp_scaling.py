"""Data-parallel scaling (issue 34): ``llmserve serve --dp N`` against --dp 1, serving only.

For each --dp value the server is started as a process (--tp fixed, so dp=2 takes twice the
GPUs), then ``serving.py`` runs two loads at --max-concurrency C:
  random         4 x C requests of random prompts (--input-len / --output-len): output tok/s
  shared-prefix  4 x C requests of one common --shared-prefix-len-token prefix and a question
                 each: output tok/s and the prefix cache's hit rate over the run
and /info says how many generations each replica ran. Each number against dp=1's, and the
issue's goal: dp=2's random-prompt throughput >= 1.8x dp=1's, and the shared-prefix hit rate
kept (>= 0.98x dp=1's: each replica computes the prefix once).

``--replica-share`` also runs one replica (dp=1) under each larger dp's share of the load, C / N
concurrent requests of the random load: N x that is what N independent replicas would serve, so
the table tells the replicas' own loss (a batch of C / N uses a GPU less well than one of C)
from what running them behind one server loses (routing, the HTTP side, the host).

Run (2 GPUs):  python benchmarks/make_random_model.py --out /tmp/llama3-8b-random
               python benchmarks/dp_scaling.py --model /tmp/llama3-8b-random --dp 1,2 --json benchmarks/results/dp_scaling.json
No checkpoint:  python benchmarks/make_random_model.py --config-only --out /tmp/llama3-8b-dummy
               python benchmarks/dp_scaling.py --model /tmp/llama3-8b-dummy --load-format dummy --dp 1,2 --api-server-count 4
Smoke (CPU):   python benchmarks/make_random_model.py --shape tiny --device cpu --out /tmp/tiny
               python benchmarks/dp_scaling.py --model /tmp/tiny --dp 1,2 --concurrency 4 --input-len 16 --output-len 8 --shared-prefix-len 64 --replica-share
"""

from __future__ import annotations

import argparse
import sys

from common import markdown_table, remove_script_dir_from_sys_path, write_json
from server_process import llmserve_server, requests_per_replica, serving_load

remove_script_dir_from_sys_path()

GOALS = {"random tok/s": 1.8, "shared-prefix hit rate": 0.98}     # dp=2 against dp=1, at least


def measure(args: argparse.Namespace, dp: int) -> dict[str, float | list[int]]:
    c = args.concurrency
    with llmserve_server(args.model, 18100 + dp, server_flags(args, dp, c)) as url:
        lengths = (args.model, c, 4 * c, args.input_len, args.output_len)
        random = serving_load(url, *lengths)
        shared = serving_load(url, *lengths, "--workload", "shared-prefix", "--shared-prefix-len",
                              str(args.shared_prefix_len), "--seed", "1")
        routed = requests_per_replica(url)
    numbers = {"random tok/s": random["output_throughput"], "shared-prefix tok/s": shared["output_throughput"],
               "shared-prefix hit rate": shared["prefix_cache"]["hit_rate"], "requests per replica": routed}
    print(f"dp={dp}: {numbers}", file=sys.stderr)
    return numbers


def replica_share(args: argparse.Namespace, dp: int) -> float:
    """One replica's random-load output tok/s under 1 / dp of the load (C / dp concurrent requests,
    4 x that many requests), times dp: what dp independent replicas would serve."""
    c = max(1, args.concurrency // dp)
    with llmserve_server(args.model, 18200 + dp, server_flags(args, 1, c)) as url:
        tok_s = serving_load(url, args.model, c, 4 * c, args.input_len, args.output_len)["output_throughput"]
    print(f"one replica at C={c}: {tok_s:.0f} tok/s", file=sys.stderr)
    return dp * tok_s


def server_flags(args: argparse.Namespace, dp: int, concurrency: int) -> list[str]:
    flags = ["--dp", str(dp), "--tp", str(args.tp), "--max-concurrent-requests", str(4 * concurrency),
             "--api-server-count", str(args.api_server_count), "--load-format", args.load_format]
    return flags + (["--dtype", args.dtype] if args.dtype else [])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF directory (benchmarks/make_random_model.py writes one)")
    p.add_argument("--dp", default="1,2", help="replica counts, the first the baseline (default: 1,2)")
    p.add_argument("--tp", type=int, default=1, help="ranks a replica (default: 1)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--shared-prefix-len", type=int, default=2000)
    p.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP processes of every server (llmserve serve --api-server-count; default: 1)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights drawn at load from --model's config.json (make_random_model.py "
                        "--config-only), as llmserve serve --load-format dummy (default: auto)")
    p.add_argument("--replica-share", action="store_true",
                   help="also run one replica under each larger dp's share of the load (C / dp): dp x its "
                        "throughput is what that many independent replicas would serve")
    p.add_argument("--json", default=None)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    dps = [int(d) for d in args.dp.split(",")]
    results = {dp: measure(args, dp) for dp in dps}
    shares = {dp: replica_share(args, dp) for dp in dps[1:]} if args.replica_share else {}
    base = results[dps[0]]
    rows = []
    for dp, numbers in results.items():
        for metric, value in numbers.items():
            if isinstance(value, list):
                rows.append([dp, metric, " / ".join(map(str, value)), "", ""])
                continue
            ratio = value / base[metric] if base[metric] else float("nan")
            goal = GOALS.get(metric) if dp == 2 else None
            verdict = "" if goal is None else f">= {goal}: " + ("met" if ratio >= goal else "MISSED")
            rows.append([dp, metric, f"{value:.3f}", f"{ratio:.3f}", verdict])
        if dp in shares:
            ideal = shares[dp]
            rows.append([dp, f"{dp} independent replicas at C={max(1, args.concurrency // dp)}, tok/s", f"{ideal:.3f}",
                         f"{ideal / base['random tok/s']:.3f}", f"dp={dp} serves {numbers['random tok/s'] / ideal:.3f}x it"])
    print(f"\n### Data-parallel scaling, tp={args.tp}, C={args.concurrency}, in {args.input_len} / out "
          f"{args.output_len}, shared prefix {args.shared_prefix_len}, {args.api_server_count} HTTP process(es)\n")
    print(markdown_table(["dp", "metric", "value", f"/ dp={dps[0]}", "goal"], rows))
    if args.json:
        write_json(args.json, {"benchmark": "dp_scaling", "model": args.model, "tp": args.tp,
                               "api_server_count": args.api_server_count,
                               "concurrency": args.concurrency, "input_len": args.input_len,
                               "output_len": args.output_len, "shared_prefix_len": args.shared_prefix_len,
                               "results": {str(dp): numbers for dp, numbers in results.items()},
                               "independent_replicas_tok_s": {str(dp): tok_s for dp, tok_s in shares.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
