"""The server when its engine cannot go on says so and exits: a hung worker (here a stopped one)
ends every open stream with an error event within ``--step-timeout``, turns /health 503 and
exits non-zero, leaving no process behind; /health asks the engine core itself, not only the
HTTP process. On a GPU, a device failure (a kernel storing out of bounds, through the test-only
``LLMSERVE_TEST_WORKER_FAULT``) ends the server the same way: ``pytest tests/server/api/test_watchdog.py
-k gpu -s`` prints how long that took."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import httpx
import pytest
import torch

from llmserve.server.engine_client import HEALTH_PROBE_TIMEOUT_S
from llmserve.worker.faults import FAULTS_VAR
from serving_utils import ServerProcess, engine_processes_of, pid_alive, sse_events, wait_until

STEP_TIMEOUT_S = 10
DEADLINE_S = 15.0      # from the hang to every stream's error event, and to a 503 or a non-zero exit
EXIT_TIMEOUT_S = 30.0  # from the hang to the server's exit, its processes all gone
LONG = 450             # new tokens: the streams are still running when the worker stops


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    """One server for the module; its last test ends it."""
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--step-timeout", str(STEP_TIMEOUT_S)) as server:
        try:
            yield server
        finally:
            for pid in [server.core_pid, *server.worker_pids]:   # a stopped process would ignore the SIGTERM
                if pid_alive(pid):
                    os.kill(pid, signal.SIGCONT)


def health(server: ServerProcess, timeout: float = 30.0) -> httpx.Response:
    return httpx.get(server.url + "/health", timeout=timeout)


def test_health_is_503_while_the_engine_core_does_not_answer(server):
    assert health(server).status_code == 200
    os.kill(server.core_pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        r = health(server)
        assert r.status_code == 503, r.text
        assert r.json()["error_type"] == "unhealthy" and "engine core has not answered" in r.json()["error"]
        assert HEALTH_PROBE_TIMEOUT_S <= time.monotonic() - started < HEALTH_PROBE_TIMEOUT_S + 5
    finally:
        os.kill(server.core_pid, signal.SIGCONT)
    wait_until(lambda: health(server).status_code == 200, 10.0, "/health turns 200 again")
    r = httpx.post(server.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, timeout=60)
    assert r.status_code == 200 and r.json()["generated_text"], r.text


async def open_streams_then(url: str, action) -> tuple[list[list[dict]], list[list[float]]]:
    """A TGI and an OpenAI stream of LONG tokens: once each has 3 events, ``action()``; then each
    stream's events and the times they came, to the stream's end."""
    bodies = [("/generate_stream", {"inputs": "Story number 1:", "parameters": {"max_new_tokens": LONG}}),
              ("/v1/completions", {"model": "tiny", "prompt": "Story number 2:", "max_tokens": LONG, "stream": True,
                                   "ignore_eos": True})]
    times: list[list[float]] = [[] for _ in bodies]
    started = [asyncio.Event() for _ in bodies]

    def on_event(i: int):
        def note() -> None:
            times[i].append(time.monotonic())
            if len(times[i]) >= 3:
                started[i].set()
        return note

    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        tasks = [asyncio.ensure_future(sse_events(client, url, path, body, on_event=on_event(i)))
                 for i, (path, body) in enumerate(bodies)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            action()
            return await asyncio.wait_for(asyncio.gather(*tasks), EXIT_TIMEOUT_S), times
        finally:
            for t in tasks:
                t.cancel()


def assert_streams_ended_with_the_error(events: list[list[dict]], words: str) -> None:
    tgi, openai = events
    assert all("token" in e for e in tgi[:-1]) and set(tgi[-1]) == {"error", "error_type"}, tgi[-3:]
    assert tgi[-1]["error_type"] == "generation" and words in tgi[-1]["error"], tgi[-1]
    assert all("choices" in e for e in openai[:-1]), openai[-3:]
    assert set(openai[-1]) == {"error"} and words in openai[-1]["error"]["message"], openai[-1]


def assert_unhealthy_or_gone(server: ServerProcess) -> None:
    """/health answers 503, or nothing: the server has stopped listening, on its way out (the
    caller checks that it exits non-zero)."""
    try:
        r = health(server, timeout=HEALTH_PROBE_TIMEOUT_S + 2)
        assert r.status_code == 503, r.text
    except httpx.TransportError:
        pass


def assert_exits_nonzero_leaving_nothing(server: ServerProcess, timeout: float) -> int:
    try:
        rc = server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server did not exit within {timeout:.0f} s:\n{server.output()}") from None
    assert rc != 0, server.output()
    processes = [server.core_pid, *server.worker_pids]
    wait_until(lambda: not any(pid_alive(p) for p in processes), 5.0, "the engine core and its workers exit")
    assert engine_processes_of(server.proc.pid) == ([], [])
    return rc


def test_a_stopped_worker_ends_the_server_within_the_step_timeout(server):
    """(Last: it ends the module's server.)"""
    [worker] = server.worker_pids
    stopped = []

    def stop_worker() -> None:
        os.kill(worker, signal.SIGSTOP)
        stopped.append(time.monotonic())

    events, times = asyncio.run(open_streams_then(server.url, stop_worker))
    assert_streams_ended_with_the_error(events, "did not finish a step within 10 s")
    assert all(STEP_TIMEOUT_S - 1 < t[-1] - stopped[0] < DEADLINE_S for t in times), [t[-1] - stopped[0] for t in times]
    assert_unhealthy_or_gone(server)
    assert time.monotonic() - stopped[0] < DEADLINE_S
    assert_exits_nonzero_leaving_nothing(server, EXIT_TIMEOUT_S - (time.monotonic() - stopped[0]))
    error_lines = [line for line in server.output().splitlines() if line.startswith("llmserve: error:")]
    assert len(error_lines) == 1 and "rank 0 did not finish a step" in error_lines[0], server.output()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_a_device_failure_ends_the_server(tiny_llama_dir):
    """The worker's 20th forward first launches a kernel that stores 4 TiB past its buffer: an
    illegal memory access, which poisons the CUDA context. Prints how long the server took to end."""
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", env={FAULTS_VAR: "device_fault=20"}) as server:
        events, times = asyncio.run(open_streams_then(server.url, lambda: None))
        assert_streams_ended_with_the_error(events, "the device failed")
        assert "illegal memory access" in events[0][-1]["error"], events[0][-1]
        # The fault comes right after the last token the streams got.
        fault = max(t[-2] for t in times)
        error_s = max(t[-1] for t in times) - fault
        assert_unhealthy_or_gone(server)
        rc = assert_exits_nonzero_leaving_nothing(server, EXIT_TIMEOUT_S)
        exit_s = time.monotonic() - fault
        print(f"\ndevice failure: every stream's error event {error_s:.2f} s after the last token before the fault, "
              f"server exited (code {rc}), its processes gone, within {exit_s:.2f} s")
        assert error_s < DEADLINE_S
        assert "rank 0: the device failed" in server.output()
