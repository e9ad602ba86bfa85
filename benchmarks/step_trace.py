"""Where an engine's time went: summarize the step trace that ``LLMSERVE_STEP_TRACE=FILE`` makes
the engine write (one JSON line per step: start, end, decode rows, prefill tokens, waiting).

  LLMSERVE_STEP_TRACE=/tmp/steps.jsonl llmserve serve ...   # or benchmarks/engine.py
  python benchmarks/step_trace.py /tmp/steps.jsonl [--skip-first 50]

Prints the number of steps, the time inside steps and between them (the engine idle, or busy
outside the forward: scheduling, receiving, sending), and step times by kind (pure decode, mixed,
pure prefill) with their mean batch shape.
"""

from __future__ import annotations

import argparse
import json
import statistics


def summarize(steps: list[dict]) -> list[str]:
    if not steps:
        return ["no steps"]
    wall = steps[-1]["end"] - steps[0]["start"]
    busy = sum(s["end"] - s["start"] for s in steps)
    gaps = [b["start"] - a["end"] for a, b in zip(steps, steps[1:])]
    lines = [
        f"steps {len(steps)}, wall {wall:.2f} s, in steps {busy:.2f} s ({busy / wall:.0%}), "
        f"between steps {sum(gaps):.2f} s (gap mean {statistics.fmean(gaps) * 1e3 if gaps else 0:.2f} ms, "
        f"max {max(gaps, default=0) * 1e3:.1f} ms)",
        f"tokens decoded {sum(s['decode'] for s in steps)}, prefilled {sum(s['prefill'] for s in steps)}",
    ]
    kinds = {
        "decode": [s for s in steps if s["prefill"] == 0],
        "mixed": [s for s in steps if s["prefill"] and s["decode"]],
        "prefill": [s for s in steps if s["prefill"] and not s["decode"]],
    }
    for kind, group in kinds.items():
        if group:
            ms = [(s["end"] - s["start"]) * 1e3 for s in group]
            lines.append(f"  {kind:8s} {len(group):6d} steps, {statistics.fmean(ms):7.2f} ms mean (p50 {statistics.median(ms):.2f}, "
                         f"max {max(ms):.1f}), decode rows {statistics.fmean(s['decode'] for s in group):.1f}, "
                         f"prefill tokens {statistics.fmean(s['prefill'] for s in group):.0f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--skip-first", type=int, default=0, help="steps to leave out (warm-up)")
    args = p.parse_args()
    with open(args.trace) as f:
        steps = [json.loads(line) for line in f if line.strip()][args.skip_first:]
    print("\n".join(summarize(steps)))


if __name__ == "__main__":
    main()
