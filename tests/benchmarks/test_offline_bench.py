"""benchmarks/offline.py runs end to end on the CPU (tiny shapes; its numbers mean nothing there),
with HF transformers as the peer on the same weights (the MoE shapes: per-expert checkpoint names
fused into the tensors transformers 5 holds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "offline.py")


@pytest.mark.parametrize("size", ["tiny", "qwen3-tiny", "gemma2-tiny", "qwen3-moe-tiny", "mixtral-tiny"])
def test_offline_benchmark_times_ours_and_the_hf_peer_on_the_same_weights(size):
    done = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--model-size", size, "--batch-sizes", "1,2",
                           "--prompt-len", "8", "--steps", "2", "--warmup-steps", "1", "--peer", "hf"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # the peer holds our weights: its logits were checked against ours before any timing
    assert "peer check: last-token logits agree" in done.stderr
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines()
            if line.startswith("|") and line.split("|")[2].strip().isdigit()]
    assert [(r[0], int(r[1])) for r in rows] == [("eager", 1), ("hf", 1), ("eager", 2), ("hf", 2)]
    assert all(float(r[3]) > 0 and float(r[7]) > 0 for r in rows)     # ms/step, and a floor for each


def test_a_float8_cache_quarters_the_floors_kv_bytes_in_float32(tmp_path):
    """--kv-cache-dtype fp8: the floor counts a byte a K or V value (float32's 4 on the CPU)."""
    kv_bytes = {}
    for kv in ("auto", "fp8"):
        out = tmp_path / f"{kv}.json"
        done = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--model-size", "tiny", "--batch-sizes", "2",
                               "--prompt-len", "16", "--steps", "2", "--warmup-steps", "1", "--kv-cache-dtype", kv,
                               "--json", str(out)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert ("KV cache fp8_e4m3" in done.stdout) == (kv == "fp8")
        result = json.loads(out.read_text())
        kv_bytes[kv] = (result["kv_bytes_per_token"], result["results"][0]["kv_bytes_per_step"])
    assert kv_bytes["auto"][0] == 4 * kv_bytes["fp8"][0] and kv_bytes["auto"][1] == 4 * kv_bytes["fp8"][1]
