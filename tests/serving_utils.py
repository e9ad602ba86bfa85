"""Starting a real ``llmserve serve`` process for end-to-end tests, and looking at it from outside."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmserve.engine.config import EngineConfig
from llmserve.sampling_params import SamplingParams
from llmserve.server.engine_client import EngineError
from llmserve.worker.protocol import WorkerInfo

# A test server has as long as it needs to become healthy while it makes progress: on a loaded
# 2-core machine starting several side by side, that can take minutes. It has failed once it has
# used no CPU time (nor its workers) and written nothing for STARTUP_STALL_S, or after
# STARTUP_LIMIT_S in all.
STARTUP_STALL_S = 120.0
STARTUP_LIMIT_S = 900.0

# The API key and body size limit of the shared keyed server (tests/server/api/conftest.py).
API_KEY = "s3cret-key"
PAYLOAD_LIMIT = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llmserve_command() -> list[str]:
    """The installed console script, as an operator would run it."""
    script = os.path.join(os.path.dirname(sys.executable), "llmserve")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "llmserve.cli"]


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (a server's engine core, a core's model workers), read from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry))
    return children


def _cmdline(pid: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _started_by(module: str, parent_pids: set[int]) -> list[int]:
    """Live processes running ``python -m module ADDRESS PARENT_PID ...`` for one of these parents."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        args = _cmdline(entry)
        if module in args:
            i = args.index(module)
            if len(args) > i + 2 and args[i + 2].isdigit() and int(args[i + 2]) in parent_pids and pid_alive(int(entry)):
                found.append(int(entry))
    return found


def engine_processes_of(server_pid: int) -> tuple[list[int], list[int]]:
    """The engine cores a server started and those cores' model workers, found by their command
    lines, which name their parent's PID: unlike the parent link, that survives an orphan's
    adoption by init."""
    cores = _started_by("llmserve.engine.core_main", {server_pid})
    return cores, _started_by("llmserve.worker.main", set(cores))


def cpu_ticks(pid: int) -> int:
    """CPU time a process has used so far (user + system, in clock ticks); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


class ServerProcess:
    """``llmserve serve --model MODEL --port <free> ARGS...`` in a subprocess."""

    def __init__(self, model: str | None, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # LLMSERVE_TEST_SERVER_ARGS: flags for every test server (on a GPU: --dtype float32, so
        # that batched and alone stay bit-identical, as on the CPU)
        extra = os.environ.get("LLMSERVE_TEST_SERVER_ARGS", "").split()
        cmd = [*llmserve_command(), "serve", "--port", str(self.port), *extra, *args]
        if model is not None:
            cmd += ["--model", model]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llmserve-test-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self._wait_until_healthy()
        # one engine core (with --dp N, one a replica, started in order) and its model workers
        self.core_pids = sorted(child_pids(self.proc.pid))
        self.core_pid = self.core_pids[0]
        self.worker_pids = child_pids(self.core_pid)

    def _wait_until_healthy(self) -> None:
        start = last_progress = time.monotonic()
        progress = self._progress()
        while (now := time.monotonic()) - last_progress < STARTUP_STALL_S and now - start < STARTUP_LIMIT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmserve serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
            if progress != (progress := self._progress()):
                last_progress = time.monotonic()
        self.proc.kill()     # its workers follow it (they watch their parent)
        self.proc.wait()
        raise RuntimeError(f"llmserve serve did not become healthy in {time.monotonic() - start:.0f} s "
                           f"({time.monotonic() - last_progress:.0f} s without progress):\n{self.output()}")

    def _progress(self) -> tuple[int, int]:
        """What grows while the server starts: the CPU time of it, its engine core and workers, its output."""
        cores = child_pids(self.proc.pid)
        ticks = sum(cpu_ticks(pid) for pid in [self.proc.pid, *cores, *(w for c in cores for w in child_pids(c))])
        return ticks, os.path.getsize(self.log.name)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def openai_client(self, api_key: str = "unused", timeout: float = 60.0) -> "openai.OpenAI":  # noqa: F821
        """The `openai` SDK pointed at this server, with no retries (a 429 or 5xx must show as such).
        Imported here: the GPU machines have no `openai`, and the server tests that need no client
        run there too."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, timeout=timeout, max_retries=0)

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """The samples of /metrics, parsed by prometheus_client, keyed ``name`` or
        ``name{label="value",...}`` without the ``model_name`` label every series has."""
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items() if k != "model_name")
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)


def greedy_completion(server: ServerProcess, model: str, **body) -> dict:
    """The first choice of a greedy ``/v1/completions`` request (``body`` adds to or overrides it)."""
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={"model": model, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


async def sse_events(client: httpx.AsyncClient, url: str, path: str, body: dict, max_events: int | None = None,
                     on_event: Callable[[], None] | None = None) -> list[dict]:
    """The JSON events of one SSE stream (OpenAI's closing ``[DONE]`` left out): all of them, or
    the first ``max_events`` and then hang up. ``on_event`` is called after each one."""
    events = []
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[len("data:"):].strip() != "[DONE]":
                events.append(json.loads(line[len("data:"):]))
                if on_event is not None:
                    on_event()
                if max_events is not None and len(events) >= max_events:
                    break
    return events


async def tgi_stream_events(client: httpx.AsyncClient, url: str, body: dict, max_events: int | None = None,
                            on_event: Callable[[], None] | None = None) -> list[dict]:
    """The JSON events of one TGI SSE stream (see ``sse_events``)."""
    return await sse_events(client, url, "/generate_stream", body, max_events, on_event)


class FailingEngine:
    """What ServerState needs of an EngineClient; ``generate`` records the params and fails."""

    def __init__(self, model_path: str, tokenizer):
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.config = EngineConfig(model=model_path)
        self.info = WorkerInfo(model_type="llama", vocab_size=len(tokenizer), max_total_token_num=512,
                               max_seq_len=512, max_running_requests=8, dtype="float32", device="cpu", num_layers=2,
                               num_params=0)
        self.received: list[SamplingParams] = []

    def route(self, prompt_token_ids, session_id=None, lora_name=None):
        return self

    def generate(self, prompt_token_ids, params, pixel_values=None, session_id=None, lora_name=None):
        self.received.append(params)
        raise EngineError("this test's engine runs nothing")

    def end_session(self, session_id: str) -> None:
        pass

    def watch_loras(self, on_changed) -> None:
        pass


async def streams_across(url: str, n: int, action, timeout: float = 30.0,
                         return_exceptions: bool = False) -> list[list[dict] | BaseException]:
    """Open ``n`` long streams, wait until each has a token, run ``action()``, then read every
    stream to its end (each must end within ``timeout``; ``return_exceptions``: a stream that
    fails, a cut connection say, gives its exception instead of raising it)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=httpx.Limits(max_connections=n)) as client:
        started = [asyncio.Event() for _ in range(n)]
        tasks = [asyncio.ensure_future(tgi_stream_events(client, url, {"inputs": f"Story number {i}:",
                                                                       "parameters": {"max_new_tokens": 400}},
                                                         on_event=started[i].set))
                 for i in range(n)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout)
            action()
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=return_exceptions), timeout)
        finally:
            for t in tasks:
                t.cancel()


def assert_ended_with_error(events: list[dict]) -> None:
    assert len(events) >= 2, events
    assert all("token" in e for e in events[:-1]), events
    last = events[-1]
    assert set(last) == {"error", "error_type"}, last
    assert isinstance(last["error"], str) and last["error"]
