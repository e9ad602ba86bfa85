"""benchmarks/fused_moe.py runs end to end on the CPU (tiny shapes, the kernel in Triton's
interpreter; its numbers mean nothing there), checking the kernel against its twin first."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "fused_moe.py")


def test_fused_moe_benchmark_prints_a_row_per_batch_with_its_floor():
    done = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--shape", "tiny", "--batch-sizes", "1,5"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines()
            if line.startswith("|") and line.split("|")[1].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [1, 5]
    assert [r[1] for r in rows] == ["gemv", "gemv"]            # up to GEMV_MAX_TOKENS tokens: the GEMV path
    assert int(rows[0][2]) == 2 and 2 <= int(rows[1][2]) <= 8   # one token hits its top 2 of 8 experts
    assert all(float(r[3]) > 0 and float(r[9]) > 0 for r in rows)   # ours us, floor us
