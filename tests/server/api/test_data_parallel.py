"""``llmserve serve --dp 2`` end to end on the CPU: one HTTP process, two engine cores of one
worker each. The replicas give one replica's greedy tokens; requests spread over them by load; a
shared prefix follows the replica that holds it; a LoRA adapter loaded at run time reaches both;
and one replica's dead worker ends the whole server (last: it stops the module's server)."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
import torch
from lora_utils import AdapterSpec, make_peft_adapter

from serving_utils import ServerProcess, child_pids, engine_processes_of, pid_alive, tgi_stream_events, wait_until

EXIT_TIMEOUT_S = 15.0
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                reason="--dp 2 on CUDA needs two GPUs (on the CPU it runs anywhere)")


@pytest.fixture(scope="module")
def dp2(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--dp", "2", "--allow-runtime-lora-updating",
                       "--max-lora-rank", "8") as server:
        yield server


def replicas(server: ServerProcess) -> list[dict]:
    return httpx.get(server.url + "/info", timeout=10).json()["replicas"]


def greedy_ids(url: str, prompt: str, **parameters) -> list[int]:
    r = httpx.post(url + "/generate", timeout=60, json={
        "inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True, **parameters}})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


async def side_by_side(url: str, bodies: list[dict], during=None) -> list[list[dict]] | None:
    """One TGI stream per body, each opened once the one before has its first token (so each finds
    the ones before it in flight). Then ``during()``, if given, runs and every client hangs up;
    else every stream's events."""
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = []
        for body in bodies:
            started = asyncio.Event()
            tasks.append(asyncio.ensure_future(tgi_stream_events(client, url, body, on_event=started.set)))
            await asyncio.wait_for(started.wait(), 60)
        if during is None:
            return await asyncio.gather(*tasks)
        await asyncio.get_running_loop().run_in_executor(None, during)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return None


def test_two_replicas_give_one_replicas_greedy_tokens(dp2, tiny_server):
    info = httpx.get(dp2.url + "/info", timeout=10).json()
    assert info["dp"] == 2 and [r["replica"] for r in info["replicas"]] == [0, 1]
    assert len(dp2.core_pids) == 2 and all(len(child_pids(core)) == 1 for core in dp2.core_pids)
    for prompt in ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]:
        assert greedy_ids(dp2.url, prompt) == greedy_ids(tiny_server.url, prompt), prompt


def test_requests_in_flight_spread_over_both_replicas(dp2):
    """Short prompts (no whole block to match) go to the least loaded replica: four streams opened
    one after another alternate; each one's abort (the client leaving) reaches its replica."""
    before = [r["requests"] for r in replicas(dp2)]
    seen = []
    bodies = [{"inputs": f"Story number {i}:", "parameters": {"max_new_tokens": 400, "ignore_eos": True}}
              for i in range(4)]
    asyncio.run(side_by_side(dp2.url, bodies, during=lambda: seen.append(replicas(dp2))))
    assert [r["requests_in_flight"] for r in seen[0]] == [2, 2]
    assert [r["requests"] - b for r, b in zip(seen[0], before)] == [2, 2]
    metrics = dp2.metrics()
    assert all(metrics[f'llmserve_replica_requests_total{{replica="{r}"}}'] >= 2 for r in (0, 1))
    wait_until(lambda: all(r["requests_in_flight"] == r["running"] == r["waiting"] == 0 for r in replicas(dp2)),
               30, "every replica ends its aborted requests")


def test_a_shared_prefix_goes_to_the_replica_holding_it(dp2):
    """Requests sharing a long prefix follow the first one's replica, whose prefix cache serves it."""
    prefix = "You are a careful assistant. Answer briefly and cite the rule you follow. " * 3
    before = replicas(dp2)
    for i in range(4):
        greedy_ids(dp2.url, prefix + f"Question {i}: what is {i} + {i}?", max_new_tokens=2)
    after = replicas(dp2)
    routed = [a["requests"] - b["requests"] for a, b in zip(after, before)]
    hits = [a["prefix_cache_hit_tokens"] - b["prefix_cache_hit_tokens"] for a, b in zip(after, before)]
    assert sorted(routed) == [0, 4], routed
    holder = routed.index(4)
    assert hits[holder] >= 3 * 32 and hits[1 - holder] == 0, hits


def test_a_lora_adapter_loaded_at_run_time_reaches_every_replica(dp2, tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    adapter = make_peft_adapter(hf, tmp_path / "late", AdapterSpec(r=8, seed=4))
    r = httpx.post(dp2.url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapter}, timeout=120)
    assert r.status_code == 200, r.text
    # long enough that the first is still running when the second arrives
    parameters = {"max_new_tokens": 64, "ignore_eos": True}
    body = {"inputs": "The capital of France is", "parameters": {**parameters, "adapter_id": "late"}}
    before = [r["requests"] for r in replicas(dp2)]
    one, other = asyncio.run(side_by_side(dp2.url, [body, body]))
    assert [r["requests"] - b for r, b in zip(replicas(dp2), before)] == [1, 1]     # one stream each
    with_adapter = [[e["token"]["id"] for e in events] for events in (one, other)]
    assert with_adapter[0] == with_adapter[1] != greedy_ids(dp2.url, "The capital of France is", **parameters)
    r = httpx.post(dp2.url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=120)
    assert r.status_code == 200, r.text


# Last: it ends the module's server.
def test_one_replicas_dead_worker_ends_the_server(dp2):
    cores, workers = engine_processes_of(dp2.proc.pid)
    assert len(cores) == 2 and len(workers) == 2
    os.kill(child_pids(dp2.core_pids[1])[0], signal.SIGKILL)
    rc = dp2.proc.wait(timeout=EXIT_TIMEOUT_S)
    assert rc != 0
    error_lines = [line for line in dp2.output().splitlines() if line.startswith("llmserve: error:")]
    assert len(error_lines) == 1 and "data-parallel replica 1" in error_lines[0] and "worker" in error_lines[0], \
        dp2.output()
    wait_until(lambda: not any(pid_alive(p) for p in cores + workers), 10.0, "every engine core and worker exits")
