"""The engine's side of the model workers: start one process per tensor-parallel rank, connect
over a unix socket, and step them all together."""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

import rpyc
from rpyc import AsyncResultTimeout
from rpyc.utils.factory import unix_connect

from llmserve.ipc import ABSTRACT_SOCKETS, socket_path
from llmserve.worker.protocol import RPYC_CONFIG, StepInput, StepOutput, WorkerError, WorkerInfo, WorkerInitArgs


def _start_worker_process(address: str) -> subprocess.Popen:
    # A fresh interpreter (not multiprocessing's spawn), so the parent's __main__ is never
    # re-imported: scripts using LLM need no `if __name__ == "__main__"` guard.
    return subprocess.Popen([sys.executable, "-m", "llmserve.worker.main", address, str(os.getpid())],
                            stdin=subprocess.DEVNULL)


class ModelRpcClient:
    """Handle on one worker process."""

    def __init__(self, proc: subprocess.Popen, conn: rpyc.Connection):
        self.proc = proc
        self.conn = conn
        self._init_model = rpyc.async_(conn.root.init_model)
        self._step = rpyc.async_(conn.root.step)
        self._read_lora = rpyc.async_(conn.root.read_lora)

    def init_model(self, args: WorkerInitArgs):
        return self._init_model(pickle.dumps(args))

    def step(self, step: StepInput):
        return self._step(pickle.dumps(step))

    def read_lora(self, name: str, path: str):
        return self._read_lora(name, path)

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass


def _stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        # A stopped process (SIGSTOP, a debugger: one way a worker hangs) acts on its SIGTERM
        # only once continued.
        proc.send_signal(signal.SIGCONT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ModelWorkerGroup:
    """All ranks of one model, stepped together.

    Made in two steps, so that the engine loads its tokenizer while the worker processes start
    (each spends seconds importing torch): ``ModelWorkerGroup(world_size)`` starts the processes,
    ``init_model(args)`` connects and loads the model in them.

    ``step_timeout``: seconds every rank has to answer a step, after which the step counts as hung
    (a stopped process, a collective that never returns) and ``step`` raises ``WorkerError``.
    None (as built) waits for ever; the engine sets it once the model is loaded, so that loading,
    the first compiles and the CUDA-graph capture have no deadline."""

    def __init__(self, world_size: int):
        self.step_timeout: float | None = None
        # Elsewhere than on Linux, socket files in a directory removed on close (a killed engine
        # leaves them behind there).
        self._tmpdir = None if ABSTRACT_SOCKETS else tempfile.TemporaryDirectory(prefix="llmserve-")
        # The engine's PID in the name tells whose workers these are (ss -xlp; tests look for it).
        prefix = f"@llmserve-{os.getpid()}-{secrets.token_hex(4)}-" if self._tmpdir is None else self._tmpdir.name + "/"
        self._started: list[tuple[str, subprocess.Popen]] = []
        self.clients: list[ModelRpcClient] = []
        try:
            for rank in range(world_size):
                address = f"{prefix}rank{rank}.sock"
                self._started.append((address, _start_worker_process(address)))
        except BaseException:
            self.close()
            raise

    def init_model(self, args: list[WorkerInitArgs]) -> WorkerInfo:
        """Connect to each rank and load the model there; the first rank's ``WorkerInfo``."""
        try:
            for address, proc in self._started:
                self.clients.append(ModelRpcClient(proc, _connect(address, proc)))
            infos = self._gather([c.init_model(a) for c, a in zip(self.clients, args)])
        except BaseException:
            self.close()
            raise
        self.info: WorkerInfo = infos[0]
        return self.info

    def step(self, step: StepInput) -> list[StepOutput]:
        """Every rank runs the step; rank 0's answer: the outputs of the steps done (see
        ``ModelWorker.step``)."""
        try:
            results = [c.step(step) for c in self.clients]
            if self.step_timeout is not None:
                for r in results:
                    r.set_expiry(self.step_timeout)
            return self._gather(results)[0]
        except WorkerError:
            raise
        except Exception as e:
            # A worker reports its requests' own failures in StepOutput; what it raises instead
            # leaves its state (KV cache, rows, sampler) unknown.
            raise WorkerError(f"a model worker's step failed: {e}") from e

    def read_lora(self, name: str, path: str) -> None:
        """Every rank reads and checks a LoRA adapter (``AdapterLoadError`` if it cannot be served),
        keeping it on the host for the step that loads it."""
        self._gather([c.read_lora(name, path) for c in self.clients])

    def _gather(self, results: list) -> list:
        out = []
        for rank, r in enumerate(results):
            try:
                out.append(pickle.loads(r.value))
            except EOFError as e:
                raise WorkerError(f"model worker rank {rank} died (exit code {self.clients[rank].proc.poll()})") from e
            except AsyncResultTimeout:
                silent = [i for i, s in enumerate(results) if not s.ready]
                raise WorkerError(f"model worker rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))} did not "
                                  f"finish a step within {self.step_timeout:g} s (--step-timeout): hung") from None
            except Exception as e:
                raise _as_local_error(e) from None
        return out

    def exit_codes(self) -> list[int | None]:
        """Each rank's exit code, None while it runs."""
        return [proc.poll() for _, proc in self._started]

    def alive(self) -> bool:
        return all(code is None for code in self.exit_codes())

    def close(self) -> None:
        # The processes first: closing a connection waits for the worker's answer, which a hung
        # worker never gives; a dead one's closes at once.
        for _, proc in self._started:
            _stop_process(proc)
        for c in self.clients:
            c.close()
        self.clients, self._started = [], []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()


def _as_local_error(e: Exception) -> Exception:
    """The worker's exception as the router should see it: same type, the worker's own one-line
    message, without the remote traceback rpyc appends (that went to the worker's stderr)."""
    message = str(e.args[0]) if e.args else type(e).__name__
    base = next((c for c in type(e).__mro__ if c.__module__ != "rpyc.core.vinegar"), RuntimeError)
    try:
        return base(message)
    except TypeError:
        return WorkerError(message)


def _connect(address: str, proc: subprocess.Popen, timeout: float = 600.0) -> rpyc.Connection:
    # Generous: a new interpreter importing torch on a busy machine can take minutes, and a worker
    # that died is noticed at once anyway.
    deadline = time.monotonic() + timeout
    while True:
        try:
            return unix_connect(socket_path(address), config=RPYC_CONFIG)
        except (FileNotFoundError, ConnectionRefusedError):
            if proc.poll() is not None:
                raise WorkerError(f"model worker exited during start-up (exit code {proc.returncode})")
            if time.monotonic() > deadline:
                raise WorkerError("model worker did not start listening in time")
            time.sleep(0.05)


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

