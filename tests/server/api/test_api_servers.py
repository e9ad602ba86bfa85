"""``llmserve serve --api-server-count 2`` end to end on the CPU: two HTTP processes on one port in
front of one engine core. Connections reach both and give one process's greedy tokens; a stream
its client leaves is aborted in the core; /metrics counts both processes' requests; a LoRA
adapter loaded through one is served by both; interactive sessions are refused; and SIGINT stops
every process (last: it stops the module's server). An HTTP process that dies ends the whole
server with an error naming it (a server of its own)."""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from lora_utils import AdapterSpec, make_peft_adapter

from serving_utils import (
    ServerProcess, assert_ended_with_error, child_pids, pid_alive, streams_across, tgi_stream_events, wait_until,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3,"]


@pytest.fixture(scope="module")
def two(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--api-server-count", "2",
                       "--allow-runtime-lora-updating", "--max-lora-rank", "8") as server:
        yield server


def processes(server: ServerProcess) -> tuple[list[int], list[int], list[int]]:
    """The launcher's other HTTP processes, its engine cores, and their workers."""
    children = child_pids(server.proc.pid)
    http = [p for p in children if "api_server_main" in open(f"/proc/{p}/cmdline").read()]
    cores = [p for p in children if p not in http]
    return http, cores, [w for core in cores for w in child_pids(core)]


def info(server: ServerProcess) -> dict:
    """/info over a connection of its own: either HTTP process may answer."""
    return httpx.get(server.url + "/info", timeout=10).json()


def requests_by_process(server: ServerProcess) -> dict[int, int]:
    """Each HTTP process's generations so far (its /info's count), asking until both have answered."""
    counts: dict[int, int] = {}
    with ThreadPoolExecutor(8) as pool:
        for _ in range(20):
            for answer in pool.map(lambda _: info(server), range(16)):
                counts[answer["api_server"]["pid"]] = answer["replicas"][0]["requests"]
            if len(counts) == 2:
                return counts
    raise AssertionError(f"only these HTTP processes answered: {counts}")


def greedy_ids(url: str, prompt: str) -> list[int]:
    r = httpx.post(url + "/generate", timeout=60, json={"inputs": prompt, "parameters": {"max_new_tokens": 12,
                                                                                          "details": True}})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def test_two_processes_serve_the_port_with_one_processs_tokens(two, tiny_server):
    answers = [info(two) for _ in range(4)]
    assert all(a["api_server"]["count"] == 2 for a in answers)
    expected = [greedy_ids(tiny_server.url, prompt) for prompt in PROMPTS]
    before = requests_by_process(two)
    metrics_before = two.metrics()
    # each request on a connection of its own, many at once: the kernel hands them to both processes
    jobs = PROMPTS * 6
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda prompt: greedy_ids(two.url, prompt), jobs))
    assert got == [expected[PROMPTS.index(prompt)] for prompt in jobs]
    served = {pid: n - before.get(pid, 0) for pid, n in requests_by_process(two).items()}
    assert sum(served.values()) == len(jobs) and all(n > 0 for n in served.values()), served
    # /metrics (from either process) counts both processes' requests and tokens, the engine's once
    for _ in range(4):
        metrics = two.metrics()
        assert metrics['llmserve_requests_total{outcome="success"}'] - \
            metrics_before['llmserve_requests_total{outcome="success"}'] == len(jobs)
        assert metrics["llmserve_generated_tokens_total"] - metrics_before["llmserve_generated_tokens_total"] == \
            sum(len(ids) for ids in got)
        assert metrics["llmserve_requests_in_flight"] == 0 and metrics["llmserve_healthy"] == 1
        assert metrics["llmserve_kv_cache_slots_total"] > 0


def test_streams_left_by_their_clients_are_aborted_in_the_core(two):
    """Eight long streams over eight connections (so both processes have some), all left mid-way:
    the core ends every one and frees its KV slots."""
    body = {"inputs": "Story:", "parameters": {"max_new_tokens": 400, "ignore_eos": True}}

    async def leave_mid_way() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            started = [asyncio.Event() for _ in range(8)]
            tasks = [asyncio.ensure_future(tgi_stream_events(client, two.url, body, on_event=event.set))
                     for event in started]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            assert two.metrics()["llmserve_running_batch_size"] == 8
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(leave_mid_way())
    wait_until(lambda: (m := two.metrics())["llmserve_running_batch_size"] == m["llmserve_queue_size"] == 0
               and m["llmserve_kv_cache_slots_used"] == 0 and m["llmserve_requests_in_flight"] == 0,
               30, "the core ends the streams their clients left")
    assert two.metrics()['llmserve_request_finished_total{finish_reason="abort"}'] >= 8


def test_a_lora_adapter_loaded_through_one_process_is_served_by_both(two, tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    adapter = make_peft_adapter(hf, tmp_path / "late", AdapterSpec(r=8, seed=4))
    r = httpx.post(two.url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapter}, timeout=120)
    assert r.status_code == 200, r.text
    listed: dict[int, list[str]] = {}
    for _ in range(200):
        answer = info(two)
        listed[answer["api_server"]["pid"]] = answer["lora_adapters"]
        models = httpx.get(two.url + "/v1/models", timeout=10).json()["data"]
        assert "late" in [m["id"] for m in models]
        if len(listed) == 2:
            break
    assert len(listed) == 2 and all(names == ["late"] for names in listed.values()), listed
    r = httpx.post(two.url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=120)
    assert r.status_code == 200, r.text
    wait_until(lambda: all(info(two)["lora_adapters"] == [] for _ in range(16)), 10, "both processes unload it")


def test_interactive_sessions_are_refused(two):
    r = httpx.post(two.url + "/v1/chat/interactive", timeout=10,
                   json={"prompt": "Hi", "session_id": 1, "interactive_mode": True})
    assert r.status_code == 501, r.text
    assert "--api-server-count 1" in r.json()["error"]["message"]


# Last: it ends the module's server.
def test_sigint_ends_every_processs_streams_and_stops_every_process(two):
    """Eight streams over eight connections (both processes', as a rule), then SIGINT to the
    launcher: every stream ends with the shutdown's error event, and every process exits."""
    http, cores, workers = processes(two)
    assert len(http) == 1 and len(cores) == 1 and len(workers) == 1
    for events in asyncio.run(streams_across(two.url, 8, lambda: two.proc.send_signal(signal.SIGINT))):
        assert_ended_with_error(events)
        assert "shutting down" in events[-1]["error"], events[-1]
    assert two.stop(timeout=30) == 0, two.output()
    wait_until(lambda: not any(pid_alive(p) for p in http + cores + workers), 10, "every process exits")
    banners = [line for line in two.output().splitlines() if "llmserve: serving" in line]
    assert len(banners) == 1, two.output()
    assert "Traceback" not in two.output(), two.output()


def test_an_http_process_that_dies_ends_the_server_with_an_error(tiny_llama_dir):
    """SIGKILL to HTTP process 1 while a stream runs on each: the launcher's stream ends with an
    error event, the server exits non-zero naming the process, and nothing is left running."""
    with ServerProcess(tiny_llama_dir, "--api-server-count", "2") as server:
        http, cores, workers = processes(server)
        results = asyncio.run(streams_across(server.url, 4, lambda: os.kill(http[0], signal.SIGKILL),
                                             return_exceptions=True))
        rc = server.proc.wait(timeout=30)
        assert rc != 0, server.output()
        for events in results:       # the dead one's streams are cut; the launcher's end with an error event
            assert isinstance(events, httpx.HTTPError) or set(events[-1]) == {"error", "error_type"}, events
        error_lines = [line for line in server.output().splitlines() if line.startswith("llmserve: error:")]
        assert len(error_lines) == 1 and f"HTTP process 1 (pid {http[0]}) exited" in error_lines[0], server.output()
        wait_until(lambda: not any(pid_alive(p) for p in http + cores + workers), 10, "every process exits")
