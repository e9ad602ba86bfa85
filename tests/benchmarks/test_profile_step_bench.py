"""benchmarks/profile_step.py runs end to end on the CPU at tp=2 (its ``--device cpu`` smoke mode:
two gloo ranks, the tiny model; the times mean nothing here): rank 0 prints the step's ops."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "profile_step.py")


def test_profile_step_profiles_rank_0_of_two():
    done = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--model-size", "tiny", "--tp", "2",
                           "--prompt-len", "16", "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "tp=2, all-reduce: GLOO" in out, out
    assert "tiny tp=2 (gloo), rank 0, batch 1: wall" in out, out
    assert out.count(": wall ") == 1     # one rank reports
    assert "c10d::allgather_" in out or "c10d::allreduce_" in out, out   # the ranks' collectives ran
