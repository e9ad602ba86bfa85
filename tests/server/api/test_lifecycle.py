"""The server process from outside: shutting down with streams open, a model worker or the
engine-core process dying, the API key, a busy port, tensor parallelism through the whole stack,
and a SIGKILL at any moment leaving nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import signal
import socket
import subprocess
import tempfile
import time

import httpx
import openai
import pytest
import text_generation
import torch

from serving_utils import (
    API_KEY, STARTUP_STALL_S, ServerProcess, assert_ended_with_error, engine_processes_of, free_port, llmserve_command,
    pid_alive, streams_across, wait_until,
)

EXIT_TIMEOUT_S = 15.0


def port_is_free(port: int) -> bool:
    """A new server could listen on it. SO_REUSEADDR as every server sets it: the connections the
    old one closed may linger in TIME_WAIT, which only a socket still listening should block."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


def assert_unhealthy_then_exits_nonzero(server: ServerProcess, after: str) -> None:
    """Right after a fatal error: /health says so for as long as the server still answers (it is
    on its way out), and it exits non-zero within EXIT_TIMEOUT_S."""
    try:
        r = httpx.get(server.url + "/health", timeout=5)
        assert r.status_code == 503, r.text
        assert r.json()["error_type"] == "unhealthy"
    except httpx.TransportError:
        pass   # it has already stopped listening; it must still exit, below
    try:
        rc = server.proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server did not exit within {EXIT_TIMEOUT_S} s of {after}:\n{server.output()}")
    assert rc != 0


def assert_turns_unhealthy_and_exits_nonzero(server: ServerProcess, after: str) -> None:
    """/health turns 503 (or the server has stopped listening), from then on never says healthy
    again, and the server exits non-zero."""
    statuses = []

    def unhealthy_or_gone() -> bool:
        try:
            statuses.append(httpx.get(server.url + "/health", timeout=2).status_code)
            return statuses[-1] == 503
        except httpx.TransportError:
            return server.proc.poll() is not None

    wait_until(unhealthy_or_gone, EXIT_TIMEOUT_S, "/health turns 503")
    statuses.clear()
    wait_until(lambda: unhealthy_or_gone() and server.proc.poll() is not None, EXIT_TIMEOUT_S,
               f"the server exits after {after}:\n{server.output()}")
    assert set(statuses) <= {503}, statuses
    assert server.proc.wait(timeout=1) != 0


# -- (1) signals with open streams -------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_ends_open_streams_and_exits_cleanly(tiny_llama_dir, sig):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny") as server:
        workers = [server.core_pid, *server.worker_pids]
        assert len(workers) == 2 and all(pid_alive(p) for p in workers)
        sent = []

        def send_signal():
            sent.append(time.monotonic())
            server.proc.send_signal(sig)

        results = asyncio.run(streams_across(server.url, 3, send_signal))
        for events in results:
            assert_ended_with_error(events)
            assert events[-1]["error_type"] == "generation"
            assert "shutting down" in events[-1]["error"]
        try:
            rc = server.proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server did not exit within {EXIT_TIMEOUT_S} s of {sig.name}:\n{server.output()}")
        assert rc == 0, f"exit code {rc}:\n{server.output()}"
        assert time.monotonic() - sent[0] < EXIT_TIMEOUT_S
        wait_until(lambda: not any(pid_alive(p) for p in workers), 5.0, "the engine core and workers exit with the server")
        assert port_is_free(server.port)
        assert "Traceback" not in server.output(), server.output()


# -- (2) a worker dies -------------------------------------------------------------------

def test_worker_death_fails_streams_and_exits_nonzero(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny") as server:
        [worker] = server.worker_pids
        killed = []

        def kill_worker():
            os.kill(worker, signal.SIGKILL)
            killed.append(time.monotonic())

        [events] = asyncio.run(streams_across(server.url, 1, kill_worker))
        assert_ended_with_error(events)
        assert events[-1]["error_type"] == "generation"

        assert_unhealthy_then_exits_nonzero(server, "its worker's death")
        assert time.monotonic() - killed[0] < EXIT_TIMEOUT_S
        assert "worker" in server.output()
        assert port_is_free(server.port)
        wait_until(lambda: not pid_alive(server.core_pid), 5.0, "the engine core exits")


def test_worker_death_while_idle_turns_health_503_and_exits_nonzero(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny") as server:
        [worker] = server.worker_pids
        os.kill(worker, signal.SIGKILL)
        assert_turns_unhealthy_and_exits_nonzero(server, "its worker's death")
        error_lines = [line for line in server.output().splitlines() if line.startswith("llmserve: error:")]
        assert len(error_lines) == 1 and "worker" in error_lines[0], server.output()


# -- (2b) the engine-core process dies -----------------------------------------------------

def test_engine_core_death_fails_streams_and_exits_nonzero(tiny_llama_dir):
    """SIGKILL of the engine core with streams open: each ends with an error event, /health
    turns 503 while the server still answers, the server exits non-zero, and the core's
    workers (orphans now) exit too."""
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny") as server:
        core, workers = server.core_pid, list(server.worker_pids)
        assert workers
        killed = []

        def kill_core():
            os.kill(core, signal.SIGKILL)
            killed.append(time.monotonic())

        results = asyncio.run(streams_across(server.url, 2, kill_core))
        for events in results:
            assert_ended_with_error(events)
            assert events[-1]["error_type"] == "generation"
            assert "engine core" in events[-1]["error"], events[-1]
        assert_unhealthy_then_exits_nonzero(server, "its engine core's death")
        assert time.monotonic() - killed[0] < EXIT_TIMEOUT_S
        error_lines = [line for line in server.output().splitlines() if line.startswith("llmserve: error:")]
        assert len(error_lines) == 1 and "engine core exited" in error_lines[0], server.output()
        wait_until(lambda: not any(pid_alive(p) for p in workers), 10.0, "the workers exit with their engine core")
        assert engine_processes_of(server.proc.pid) == ([], [])
        assert port_is_free(server.port)


def test_engine_core_death_while_idle_turns_health_503_and_exits_nonzero(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny") as server:
        workers = list(server.worker_pids)
        os.kill(server.core_pid, signal.SIGKILL)
        assert_turns_unhealthy_and_exits_nonzero(server, "its engine core's death")
        wait_until(lambda: not any(pid_alive(p) for p in workers), 10.0, "the workers exit with their engine core")


# -- (3) --api-key -----------------------------------------------------------------------

# keyed_server: the session's tiny server behind --api-key API_KEY (conftest)

PROTECTED = [
    ("POST", "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/info", None),
]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}],
                         ids=["none", "wrong", "no-scheme", "basic"])
@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_api_key_required(keyed_server, method, path, body, headers):
    r = httpx.request(method, keyed_server.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    payload = r.json()
    message = payload["error"]["message"] if path.startswith("/v1/") else payload["error"]
    assert "Unauthorized" in message


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_api_key_accepted(keyed_server, method, path, body):
    r = httpx.request(method, keyed_server.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60)
    assert r.status_code == 200, r.text


def test_health_needs_no_key(keyed_server):
    assert httpx.get(keyed_server.url + "/health", timeout=10).status_code == 200


def test_clients_with_api_key(keyed_server):
    client = keyed_server.openai_client(api_key=API_KEY)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.completions.create(model="tiny", prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True}).usage.completion_tokens == 2
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        keyed_server.openai_client(api_key="wrong").models.list()

    tgi = text_generation.Client(keyed_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert tgi.generate("Hello", max_new_tokens=2).details.generated_tokens == 2
    assert len(list(tgi.generate_stream("Hello", max_new_tokens=2))) == 2
    with pytest.raises(text_generation.errors.UnknownError, match="Unauthorized"):
        text_generation.Client(keyed_server.url, timeout=60).generate("Hello", max_new_tokens=2)


# -- (4) a busy port ---------------------------------------------------------------------

def test_busy_port_fails_fast_with_one_line(tiny_llama_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([*llmserve_command(), "serve", "--model", tiny_llama_dir, "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [f"llmserve: error: cannot listen on 127.0.0.1:{port}: Address already in use"], proc.stderr
    # before any model loading: the time it takes to import the package, not to start workers
    assert elapsed < 30, elapsed


# -- (5) tensor parallelism through the server -------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="tp=2 on CUDA needs two GPUs (on the CPU it runs anywhere)")
def test_tp2_server_matches_tp1(tiny_server, tiny_llama_dir):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]

    def greedy(url: str, prompt: str) -> list[int]:
        r = httpx.post(url + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 16, "details": True}},
                       timeout=60)
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--tp", "2") as tp2:
        assert len(tp2.worker_pids) == 2
        assert httpx.get(tp2.url + "/info", timeout=10).json()["tp"] == 2
        for prompt in prompts:
            assert greedy(tp2.url, prompt) == greedy(tiny_server.url, prompt), prompt
        workers = [tp2.core_pid, *tp2.worker_pids]
    assert tp2.proc.returncode == 0
    assert not any(pid_alive(p) for p in workers)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc")
def test_the_engine_core_runs_without_torch(tiny_server):
    """The engine core deals in token ids only (the HTTP process detokenizes and matches stop
    strings), so it never loads torch: its start costs a fraction of a second, not seconds."""
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 6, "stop": ["e"], "decoder_input_details": True}}
    r = httpx.post(tiny_server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    with open(f"/proc/{tiny_server.core_pid}/maps") as f:
        libraries = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    assert not [lib for lib in libraries if "torch" in os.path.basename(lib)], sorted(libraries)
    # and the worker, for contrast, has it
    with open(f"/proc/{tiny_server.worker_pids[0]}/maps") as f:
        assert "libtorch" in f.read()


# -- (6) SIGKILL: nothing of the server stays behind ---------------------------------------

def unix_sockets_of(pids: list[int]) -> list[str]:
    """The unix sockets named after these processes (the server's engine core's, the core's
    workers'), as /proc/net/unix lists them: "@name" for the abstract namespace, a path for a file."""
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    return [row[7] for row in rows if len(row) > 7 and any(f"llmserve-{pid}-" in row[7] for pid in pids)]


def socket_files() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "llmserve-*", "*.sock")))


def all_engine_pids(server_pid: int) -> list[int]:
    cores, workers = engine_processes_of(server_pid)
    return [*cores, *workers]


@pytest.mark.skipif(not os.path.exists("/proc/net/unix"), reason="reads Linux's /proc")
@pytest.mark.parametrize("moment", ["core_starting", "worker_starting", "worker_listening", "serving"])
def test_sigkill_leaves_no_engine_core_no_worker_and_no_socket(tiny_llama_dir, moment):
    """Whenever the server is SIGKILLed (here: as soon as its engine-core process exists, as
    soon as the core's worker exists, once that listens, i.e. while the model loads, and while it
    serves), its engine core and workers exit within seconds and no socket remains, on disk or
    anywhere."""
    files_before = socket_files()
    with contextlib.ExitStack() as cleanup:
        if moment == "serving":
            server = cleanup.enter_context(ServerProcess(tiny_llama_dir, "--served-model-name", "tiny"))
            proc = server.proc
            assert unix_sockets_of([proc.pid, server.core_pid])
        else:
            proc = subprocess.Popen([*llmserve_command(), "serve", "--model", tiny_llama_dir, "--port", str(free_port())],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            cleanup.callback(proc.kill)   # should an assertion fail before the kill
            if moment == "core_starting":
                wait_until(lambda: engine_processes_of(proc.pid)[0] or proc.poll() is not None, STARTUP_STALL_S,
                           "the engine core starts")
            else:
                wait_until(lambda: engine_processes_of(proc.pid)[1] or proc.poll() is not None, STARTUP_STALL_S,
                           "a worker starts")
            if moment == "worker_listening":
                wait_until(lambda: unix_sockets_of(engine_processes_of(proc.pid)[0]) or proc.poll() is not None,
                           STARTUP_STALL_S, "it listens")
            assert proc.poll() is None
        pids = all_engine_pids(proc.pid)
        assert pids
        # every socket of the server's is abstract: no file to leave behind, whatever happens
        names = unix_sockets_of([proc.pid, *pids])
        assert all(name.startswith("@") for name in names), names

        proc.kill()
        proc.wait()
        wait_until(lambda: not any(pid_alive(p) for p in pids) and not all_engine_pids(proc.pid), 10.0,
                   f"the engine core and workers exit ({moment})")
        # (the kernel may let go of a dead process's listening socket a moment after it is gone)
        wait_until(lambda: not unix_sockets_of([proc.pid, *pids]), 5.0, f"the sockets go ({moment})")
        assert socket_files() <= files_before
