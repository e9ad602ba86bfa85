"""A benchmark's ``llmserve serve`` process, and ``serving.py``'s load against it (tp_scaling.py,
dp_scaling.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
STARTUP_LIMIT_S = 1800     # a 70B model on a slow disk


@contextlib.contextmanager
def llmserve_server(model: str, port: int, flags: list[str]) -> Iterator[str]:
    """``llmserve serve --model MODEL --port PORT FLAGS...`` until healthy; its base URL. Stopped
    (SIGTERM) on leaving."""
    what = " ".join(["llmserve serve", *flags])
    server = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "serve", "--model", model, "--port", str(port),
                               *flags])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_LIMIT_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"{what} exited with {server.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not become healthy")
            time.sleep(1)
        yield url
    finally:
        server.terminate()
        server.wait()


def serving_load(url: str, tokenizer: str, concurrency: int, num_prompts: int, input_len: int, output_len: int,
                 *workload: str) -> dict:
    """``serving.py``'s summary of ``num_prompts`` requests at ``--max-concurrency concurrency``
    (random prompts, or ``workload``'s flags: ``--workload shared-prefix ...``)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, os.path.join(HERE, "serving.py"), "--base-url", url,
                        "--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts),
                        "--input-len", str(input_len), "--output-len", str(output_len), "--tokenizer", tokenizer,
                        "--result-file", out.name, *workload], check=True)
        with open(out.name) as f:
            return json.load(f)["summary"]


def requests_per_replica(url: str) -> list[int]:
    """Generations each data-parallel replica ran, from /metrics: the whole server's count, which
    /info's per-replica counts are not with --api-server-count > 1 (each HTTP process's own)."""
    from prometheus_client.parser import text_string_to_metric_families

    routed = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "llmserve_replica_requests_total":
                routed[int(sample.labels["replica"])] = int(sample.value)
    return [routed[r] for r in sorted(routed)]
