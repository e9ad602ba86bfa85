"""benchmarks/lora.py runs end to end on the CPU (tiny shapes; its numbers mean nothing there)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "lora.py")


def test_lora_benchmark_times_base_adapters_and_loading(tmp_path):
    out = tmp_path / "lora.json"
    done = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--model-size", "tiny", "--batch-sizes", "1,3",
                           "--num-adapters", "2", "--prompt-len", "8", "--steps", "2", "--warmup-steps", "1",
                           "--load-repeats", "2", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "lora (2 adapters)" in done.stdout and "on-demand load" in done.stdout
    assert out.exists()
