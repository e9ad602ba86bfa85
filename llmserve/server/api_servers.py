"""``llmserve serve --api-server-count N``: N HTTP processes serve one port in front of the engine.

One HTTP process spends ~143 us of its core per streamed token (uvloop, socket writes, FastAPI,
detokenization, JSON: benchmarks/frontend_cost.py), which caps a server near 7,000 streamed
tokens/s however fast the GPUs are. So, as vLLM's flag of the same name does, the launcher (the
process ``llmserve serve`` runs, HTTP process 0) binds the listen socket once and starts N - 1
more HTTP processes (``python -m llmserve.server.api_server_main``) that inherit it: the kernel
hands each new connection to whichever process accepts it first. Each HTTP process has its own
connection to every engine core (``engine/core.py``) and its own tokenizer, detokenizes its own
streams and numbers its requests apart from the others'.

The launcher is one of the N rather than a process that only supervises: with N = 1 the server is
exactly the single process it always was, and it holds the tokenizer and the checked model the
others would otherwise wait for anyway. It starts the others once the engine is ready (so the
core hears from it first, and a start-up failure is reported as with one process), waits until
each serves, and only then prints the one banner.

Per process, by design: --max-concurrent-requests (each admits up to it), the prefix-aware
routing of --dp (each its own ``CacheAwareRouter``), /info's request counts. Shared: /metrics
(``ServerMetrics`` in multiprocess mode: any process answers with the whole server's counts),
/health (each asks the core), runtime LoRA loads (the core tells the others, ``LoraChanged``).
Interactive sessions keep their turns in one process, so they are refused (501) with N > 1.

Stopping: SIGINT or SIGTERM reaches the launcher (a terminal's Ctrl-C reaches them all; the
others ignore SIGINT and wait for the launcher's SIGTERM); it ends its open streams, sends
SIGTERM to the others, waits for them to drain and exit, then tells the core to stop. An HTTP
process that dies stops the whole server with an error, as a dead engine core does; the core
itself aborts a vanished process's requests and serves the others until then.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.server.api.state import ServerConfig
from llmserve.server.engine_client import EngineError

logger = logging.getLogger(__name__)

_POLL_S = 0.5            # how often the launcher checks that the others live
_STOP_TIMEOUT_S = 15.0   # for one to drain its streams (uvicorn's grace period, and more) and exit


@dataclass
class ApiServerSpec:
    """What HTTP process ``config.api_server`` needs, sent on its stdin."""
    config: ServerConfig
    model_path: str
    core_addresses: list[str]      # each data-parallel replica's engine core
    log_level: str
    listen_fd: int                 # the launcher's listen socket, inherited
    ready_fd: int                  # written to once it serves


class ApiServerProcesses:
    """HTTP processes 1 .. N-1, as the launcher sees them."""

    def __init__(self, config: ServerConfig, model_path: str, core_addresses: list[str], log_level: str,
                 listen_socket: socket.socket):
        self.procs: list[subprocess.Popen] = []
        self._ready_pipes: list[int] = []
        self.stopping = False
        for index in range(1, config.api_server_count):
            ready_r, ready_w = os.pipe()
            spec = ApiServerSpec(dataclasses.replace(config, api_server=index), model_path, core_addresses, log_level,
                                 listen_socket.fileno(), ready_w)
            proc = subprocess.Popen([sys.executable, "-m", "llmserve.server.api_server_main", str(os.getpid())],
                                    stdin=subprocess.PIPE, pass_fds=(listen_socket.fileno(), ready_w))
            os.close(ready_w)
            self.procs.append(proc)
            self._ready_pipes.append(ready_r)
            try:
                proc.stdin.write(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
                proc.stdin.close()
            except OSError:
                pass        # it died already: wait_ready says so

    def wait_ready(self, check_cores: Callable[[], None]) -> None:
        """Until every one serves; ``EngineError`` if one exits first, or if ``check_cores()`` says
        an engine core did (they would wait for it for ever)."""
        pending = dict(zip(self._ready_pipes, range(1, len(self.procs) + 1)))
        while pending:
            ready, _, _ = select.select(list(pending), [], [], _POLL_S)
            for fd in ready:
                index = pending.pop(fd)
                if not os.read(fd, 1):       # it exited without a word
                    raise self._exited(index, "while starting")
            for fd, index in pending.items():
                if self.procs[index - 1].poll() is not None:
                    raise self._exited(index, "while starting")
            check_cores()
        for fd in self._ready_pipes:
            os.close(fd)
        self._ready_pipes = []

    async def watch(self, on_exit: Callable[[EngineError], None]) -> None:
        """Call ``on_exit`` once, when one of them exits before ``stop``."""
        while not self.stopping:
            for index, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and not self.stopping:
                    on_exit(self._exited(index, "while serving"))
                    return
            await asyncio.sleep(_POLL_S)

    def stop(self) -> None:
        """SIGTERM each (it drains its streams as the launcher does), then wait for all to exit."""
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("HTTP process %d did not stop in %g s; killing it", proc.pid, _STOP_TIMEOUT_S)
                proc.kill()
                proc.wait()
        for fd in self._ready_pipes:
            os.close(fd)
        self._ready_pipes = []

    def _exited(self, index: int, when: str) -> EngineError:
        proc = self.procs[index - 1]
        try:
            proc.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        return EngineError(f"HTTP process {index} (pid {proc.pid}) exited {when} (exit code {proc.returncode})")

