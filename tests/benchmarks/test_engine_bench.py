"""benchmarks/engine.py runs end to end (on the tiny model; its numbers mean nothing on a CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "engine.py")


def test_engine_benchmark_keeps_c_requests_in_flight_and_prints_its_table(tiny_llama_dir):
    done = subprocess.run([sys.executable, SCRIPT, "--model", tiny_llama_dir, "--concurrency", "1,3",
                           "--num-prompts", "5", "--input-len", "8", "--output-len", "3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [(int(r[1]), int(r[2])) for r in rows] == [(1, 5), (3, 5)]
    assert all(float(r[3]) > 0 for r in rows)
