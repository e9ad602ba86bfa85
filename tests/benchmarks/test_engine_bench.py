"""benchmarks/engine.py runs end to end (on the tiny model; its numbers mean nothing on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "engine.py")


def test_engine_benchmark_keeps_c_requests_in_flight_and_prints_its_table(tiny_llama_dir):
    done = subprocess.run([sys.executable, SCRIPT, "--model", tiny_llama_dir, "--concurrency", "1,3",
                           "--num-prompts", "5", "--input-len", "8", "--output-len", "3", "--loops", "plain,overlap"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in done.stdout.splitlines()
            if line.startswith("|") and line.split("|")[1].strip() in ("plain", "overlap")]
    assert [(r[0], int(r[1]), int(r[2])) for r in rows] == [("plain", 1, 5), ("plain", 3, 5), ("overlap", 1, 5), ("overlap", 3, 5)]
    assert all(float(r[3]) > 0 for r in rows)


def test_step_trace_records_every_step_and_the_summary_adds_them_up(tiny_llama_dir, tmp_path):
    trace = tmp_path / "steps.jsonl"
    done = subprocess.run([sys.executable, SCRIPT, "--model", tiny_llama_dir, "--concurrency", "2",
                           "--num-prompts", "4", "--input-len", "8", "--output-len", "3"],
                          capture_output=True, text=True, timeout=300, env=os.environ | {"LLMSERVE_STEP_TRACE": str(trace)})
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import step_trace
    finally:
        sys.path.pop(0)
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    # 2 warm-up + 4 timed requests of 8 prompt tokens and 3 output tokens: each prompt is
    # prefilled once (its first token sampled there), each later token costs a decode row
    assert sum(s["prefill"] for s in steps) == 6 * 8
    assert sum(s["decode"] for s in steps) == 6 * 2
    assert all(s["end"] >= s["start"] for s in steps)
    summary = step_trace.summarize(steps)
    assert summary[0].startswith(f"steps {len(steps)},") and "tokens decoded 12, prefilled 48" in summary[1]
