"""The engine's side of the model workers: start one process per tensor-parallel rank of this
node, connect to rank 0 over a unix socket, and step them all through it."""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import rpyc
from rpyc.utils.factory import unix_connect

from llmserve.engine.config import EngineConfig
from llmserve.ipc import ABSTRACT_SOCKETS, socket_path
from llmserve.worker.protocol import RPYC_CONFIG, StepInput, StepOutput, WorkerError, WorkerInfo, WorkerInitArgs


def _start_worker_process(*args: str) -> subprocess.Popen:
    # A fresh interpreter (not multiprocessing's spawn), so the parent's __main__ is never
    # re-imported: scripts using LLM need no `if __name__ == "__main__"` guard.
    return subprocess.Popen([sys.executable, "-m", "llmserve.worker.main", *args, str(os.getpid())],
                            stdin=subprocess.DEVNULL)


def start_followers(dist_init_addr: str, ranks: range, join_timeout: float) -> dict[int, subprocess.Popen]:
    """Start the worker processes of ranks other than 0 (``worker/ranks.py``): they find rank 0
    through its store at ``dist_init_addr``, waiting up to ``join_timeout`` for it to come up."""
    started: dict[int, subprocess.Popen] = {}
    try:
        for rank in ranks:
            started[rank] = _start_worker_process("follow", dist_init_addr, str(rank), str(join_timeout))
    except BaseException:
        for proc in started.values():
            stop_process(proc)
        raise
    return started


class ModelRpcClient:
    """Handle on rank 0's worker process."""

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


def stop_process(proc: subprocess.Popen) -> None:
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


# How often a wait for rank 0 looks whether another rank has ended meanwhile.
_CHECK_INTERVAL_S = 0.5


class ModelWorkerGroup:
    """All ranks of one model. The engine talks to rank 0 only, which hands each step to the
    other ranks (``common.distributed.StepChannel``) and answers for them all.

    Made in two steps, so that the engine loads its tokenizer while the worker processes start
    (each spends seconds importing torch): ``ModelWorkerGroup(world_size)`` starts this node's
    processes, ``init_model(args)`` connects and loads the model in them. With ``nnodes`` > 1
    this node (the head) starts ranks 0 .. world_size / nnodes - 1, and the others run on the
    other nodes (``llmserve serve --headless``), all meeting at ``dist_init_addr``.

    ``step_timeout``: seconds rank 0 has to answer a step, after which the step counts as hung
    (a stopped process, a collective that never returns) and ``step`` raises ``WorkerError``.
    None (as built) waits for ever; the engine sets it once the model is loaded, so that loading,
    the first compiles and the CUDA-graph capture have no deadline."""

    def __init__(self, world_size: int, nnodes: int = 1, dist_init_addr: str | None = None):
        if world_size % nnodes:
            raise ValueError(f"{world_size} ranks (tp x pp) do not split over {nnodes} nodes")
        self.step_timeout: float | None = None
        self.world_size, self.nnodes = world_size, nnodes
        self.dist_init_addr = dist_init_addr or (f"127.0.0.1:{free_tcp_port()}" if world_size > 1 else "")
        # Elsewhere than on Linux, socket files in a directory removed on close (a killed engine
        # leaves them behind there).
        self._tmpdir = None if ABSTRACT_SOCKETS else tempfile.TemporaryDirectory(prefix="llmserve-")
        # The engine's PID in the name tells whose workers these are (ss -xlp; tests look for it).
        prefix = f"@llmserve-{os.getpid()}-{secrets.token_hex(4)}-" if self._tmpdir is None else self._tmpdir.name + "/"
        self._address = f"{prefix}rank0.sock"
        self._started: dict[int, subprocess.Popen] = {}   # this node's ranks
        self.client: ModelRpcClient | None = None
        # Rank 0 again, on a connection of its own: asked whether a rank on another node ended
        # (exposed_failure) by whichever thread waits, the step's or the engine core's loop,
        # under the lock, while the step's connection may be busy.
        self._monitor: rpyc.Connection | None = None
        self._monitor_lock = threading.Lock()
        try:
            self._started[0] = _start_worker_process(self._address)
            # Generous: rank 0 hosts the store once the engine knows the model, seconds later.
            self._started.update(start_followers(self.dist_init_addr, range(1, world_size // nnodes), 600.0))
        except BaseException:
            self.close()
            raise

    @classmethod
    def of(cls, config: EngineConfig) -> ModelWorkerGroup:
        return cls(config.world_size, config.nnodes, config.dist_init_addr)

    @property
    def pids(self) -> list[int]:
        """The process ids of this node's ranks (benchmarks read their CPU time)."""
        return [proc.pid for proc in self._started.values()]

    def init_model(self, args: WorkerInitArgs) -> WorkerInfo:
        """Connect to rank 0 and load the model in every rank (``args`` are rank 0's, the others
        take theirs from it); rank 0's ``WorkerInfo``."""
        try:
            proc = self._started[0]
            self.client = ModelRpcClient(proc, _connect(self._address, proc))
            if self.nnodes > 1:
                self._monitor = _connect(self._address, proc)
            self.info: WorkerInfo = self._wait(self.client.init_model(args), None)
        except BaseException:
            self.close()
            raise
        return self.info

    def step(self, step: StepInput) -> list[StepOutput]:
        """Every rank runs the step; rank 0's answer: the outputs of the steps done (see
        ``ModelWorker.step``)."""
        try:
            return self._wait(self.client.step(step), self.step_timeout)
        except WorkerError:
            raise
        except Exception as e:
            # A worker reports its requests' own failures in StepOutput; what it raises instead
            # leaves its state (KV cache, rows, sampler) unknown.
            raise WorkerError(f"a model worker's step failed: {e}") from e

    def read_lora(self, name: str, path: str) -> None:
        """Rank 0 reads and checks a LoRA adapter (``AdapterLoadError`` if it cannot be served),
        keeping it on the host for the step that loads it. The other ranks read it from the same
        path when that step reaches them (``StepInput.lora_loads`` carries the path)."""
        self._wait(self.client.read_lora(name, path), self.step_timeout)

    def _wait(self, result, timeout: float | None):
        """Rank 0's answer, waiting up to ``timeout`` (None: for ever); meanwhile, every
        ``_CHECK_INTERVAL_S``, whether a rank ended (whose collective rank 0 may wait in forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # Served here rather than through the result's expiry: rpyc drops a reply that
            # arrives after its result expired, and this waits in slices.
            while not result.ready:
                if self.client.conn.serve(_CHECK_INTERVAL_S):
                    continue
                if (failure := self.failure()) is not None:
                    raise WorkerError(failure)
                if deadline is not None and time.monotonic() >= deadline:
                    waited = " (or a rank it waits for)" if self.world_size > 1 else ""
                    raise WorkerError(f"model worker rank 0{waited} did not finish a step within {timeout:g} s "
                                      "(--step-timeout): hung")
            return pickle.loads(result.value)
        except WorkerError:
            raise
        except EOFError as e:
            died = f"model worker rank 0 died (exit code {self._started[0].poll()})"
            raise WorkerError(self.failure() or died) from e
        except Exception as e:
            # rank 0's own error; the end of another rank, if one ended, is what caused it
            failure = self.failure()
            raise (WorkerError(failure) if failure is not None else _as_local_error(e)) from None

    def failure(self) -> str | None:
        """Why the ranks cannot go on, if one of them ended: a process of this node that exited,
        or what a rank on another node reported (through rank 0) before it ended."""
        for rank, proc in self._started.items():
            if (code := proc.poll()) is not None:
                return f"model worker rank {rank} exited (exit code {code})"
        if self._monitor is None:
            return None
        with self._monitor_lock:
            try:
                return self._monitor.root.failure()
            except Exception:     # rank 0 is ending: the next look finds its exit code
                return None

    def close(self) -> None:
        # The other ranks leave their loops (on every node) when rank 0 says so; if it cannot, they
        # end anyway once rank 0 is gone (their broadcast from it fails).
        if self.client is not None and self.world_size > 1 and self._started[0].poll() is None:
            try:
                ended = rpyc.async_(self.client.conn.root.shutdown)()
                ended.set_expiry(2.0)
                ended.wait()
            except Exception:
                pass
        # The processes first: closing a connection waits for the worker's answer, which a hung
        # worker never gives; a dead one's closes at once.
        for proc in self._started.values():
            stop_process(proc)
        for conn in (self.client, self._monitor):
            if conn is not None:
                conn.close()
        self.client, self._monitor, self._started = None, None, {}
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

