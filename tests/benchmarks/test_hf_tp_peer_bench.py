"""benchmarks/hf_tp_peer.py (tp_scaling.py's HF peer) runs end to end: one rank here, as torchrun's
ranks each run it (the tiny model; its numbers mean nothing on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "hf_tp_peer.py")


def test_hf_tp_peer_times_a_decode_step_at_each_batch(tiny_llama_dir, tmp_path):
    out = tmp_path / "hf.json"
    done = subprocess.run([sys.executable, SCRIPT, "--model", tiny_llama_dir, "--batch-sizes", "1,2", "--prompt-len", "8",
                           "--warmup-steps", "1", "--steps", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["tp"] == 1 and set(result["tpot_ms"]) == {"1", "2"} and all(v > 0 for v in result["tpot_ms"].values())
