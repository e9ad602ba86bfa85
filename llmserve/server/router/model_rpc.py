"""Model workers: one process per tensor-parallel rank, driven over rpyc.

Every step the router sends all ranks the same batch description; each rank runs its share of
the forward (the collectives inside line them up), and rank 0 samples and returns the ids.
Messages are pickled dataclasses sent as bytes, which keeps rpyc's proxies out of the hot path.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import rpyc
import torch
from rpyc.utils.factory import unix_connect
from rpyc.utils.server import ThreadedServer

from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmserve.server.router.sampler import SampleResult

logger = logging.getLogger(__name__)

RPYC_CONFIG = {
    "allow_pickle": False,
    "sync_request_timeout": None,      # loading a large model takes minutes
    "import_custom_exceptions": True,  # a worker's ModelLoadError arrives as a ModelLoadError
    "instantiate_custom_exceptions": True,
}


class WorkerError(RuntimeError):
    """A model worker failed or died; the engine cannot go on."""


@dataclass
class WorkerInitArgs:
    model_path: str
    model_type: str                  # picks the model class (the router has read the config already)
    tp_rank: int
    world_size: int
    device: str                      # "cpu" or "cuda" (rank r takes cuda:r)
    dtype: str | None = None         # "float32" | "float16" | "bfloat16" | None (model default)
    max_total_token_num: int | None = None
    mem_fraction: float = 0.85
    max_req_num: int = 256
    dist_init_method: str = ""       # tcp://127.0.0.1:PORT when world_size > 1
    eos_token_ids: list[int] = field(default_factory=list)  # banned by the sampler below min_tokens


@dataclass
class WorkerInfo:
    """What the router needs to know about the loaded model."""
    model_type: str
    vocab_size: int
    max_total_token_num: int
    max_seq_len: int
    max_req_num: int
    dtype: str
    device: str
    num_layers: int
    num_params: int


@dataclass
class BatchEntry:
    req_id: int
    token_ids: list[int]             # the new tokens of this step
    num_cached: int                  # tokens of this request already in the KV cache
    params: SamplingParams | None = None          # sent with a prefill (num_cached == 0)
    prompt_token_ids: list[int] | None = None     # likewise (for the repetition penalty)
    # The request's first prefill, and it asked for prompt logprobs (a re-prefill after a
    # preemption never does: they were computed the first time).
    want_prompt_logprobs: bool = False
    # Sample a token from this entry's last row (false for a chunk of a prompt that continues
    # next step: drawing there would shift the request's random stream).
    sample: bool = True


@dataclass
class StepInput:
    entries: list[BatchEntry]
    finished_req_ids: list[int] = field(default_factory=list)   # free KV and sampling state
    preempted_req_ids: list[int] = field(default_factory=list)  # free KV only; they come back later


@dataclass
class StepOutput:
    # Per entry; None where the entry did not sample (a chunk of a prompt that continues).
    token_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    # Per entry: None unless it had want_prompt_logprobs; see sampler.prompt_logprobs.
    prompt_logprobs: list[list[float | None] | None]
    prompt_top_logprobs: list[list[list[tuple[int, float]] | None] | None]


class ModelWorker:
    """One rank: owns the model, its KV cache and the request -> table-row map."""

    def __init__(self, args: WorkerInitArgs):
        from llmserve.common.basemodel import ModelInitParams
        from llmserve.common.distributed import init_distributed
        from llmserve.models.registry import get_model_class
        from llmserve.server.router.sampler import Sampler

        self.args = args
        device = torch.device(args.device if args.device == "cpu" else f"cuda:{args.tp_rank}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            # ranks share the machine's cores; each one taking all of them would oversubscribe
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
        init_distributed(args.tp_rank, args.world_size, args.dist_init_method, device)
        params = ModelInitParams(
            model_path=args.model_path, tp_rank=args.tp_rank, world_size=args.world_size, device=str(device),
            dtype=getattr(torch, args.dtype) if args.dtype else None, max_total_token_num=args.max_total_token_num,
            mem_fraction=args.mem_fraction, max_req_num=args.max_req_num,
        )
        model_cls = get_model_class(args.model_type)
        self.model = model_cls(params)
        self.device = device
        self.sampler = Sampler(eos_token_ids=args.eos_token_ids) if args.tp_rank == 0 else None
        self.req_rows: dict[int, int] = {}   # req_id -> row of req_to_token

    def info(self) -> WorkerInfo:
        m = self.model
        # by identity: a tied lm_head is the embedding tensor itself
        tensors = {id(t): t for w in [m.pre_post_weight, *m.trans_layers_weight] for t in vars(w).values()
                   if isinstance(t, torch.Tensor) and t.is_floating_point()}
        n_params = sum(t.numel() for t in tensors.values())
        return WorkerInfo(
            model_type=m.network_config_.model_type, vocab_size=m.vocab_size, max_total_token_num=m.max_total_token_num,
            max_seq_len=m.max_seq_len, max_req_num=self.args.max_req_num, dtype=str(m.data_type).removeprefix("torch."),
            device=str(self.device), num_layers=m.layers_num, num_params=n_params * self.args.world_size,
        )

    def step(self, step: StepInput) -> StepOutput | None:
        for req_id in step.preempted_req_ids:
            self._free_kv(req_id)
        for req_id in step.finished_req_ids:
            self._free_kv(req_id)
            if self.sampler is not None:
                self.sampler.remove_request(req_id)
        if not step.entries:
            return None

        rows = []
        for e in step.entries:
            if e.req_id not in self.req_rows:
                self.req_rows[e.req_id] = self.model.req_manager.alloc_req()
            rows.append(self.req_rows[e.req_id])
            if e.params is not None and self.sampler is not None:
                self.sampler.add_request(e.req_id, e.params, e.prompt_token_ids or [])
        input_ids = torch.tensor([t for e in step.entries for t in e.token_ids], dtype=torch.int64)
        q_lens = [len(e.token_ids) for e in step.entries]
        # The same flag on every rank: the lm_head's all-gather is a collective.
        all_logits = [e.want_prompt_logprobs for e in step.entries]
        logits = self.model.forward(input_ids, rows, [e.num_cached for e in step.entries], q_lens, return_all_logits=all_logits)
        if self.sampler is None:
            return None
        # An asking entry has one row of logits per new token, the others one, entries back to back.
        row_ends = list(itertools.accumulate(q if flag else 1 for q, flag in zip(q_lens, all_logits)))
        prompt_lps, prompt_tops = self._prompt_logprobs(logits, step.entries, row_ends)
        sampled = [e for e in step.entries if e.sample]
        if sampled and row_ends[-1] != len(sampled):
            # Keep the last row of each entry that samples. (The common step, one row per entry
            # and all sampling, skips this.)
            last_rows = [end - 1 for end, e in zip(row_ends, step.entries) if e.sample]
            logits = logits[torch.tensor(last_rows, dtype=torch.long, device=logits.device)]
        result = self.sampler.sample(logits, [e.req_id for e in sampled]) if sampled else None
        return StepOutput(*_per_entry(step.entries, result), prompt_lps, prompt_tops)

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, entries: list[BatchEntry], row_ends: list[int]) -> tuple[list, list]:
        """Per entry, its prompt logprobs, or None if it did not ask; entry i's rows of ``logits``
        end at ``row_ends[i]``."""
        from llmserve.server.router.sampler import prompt_logprobs

        logprobs: list[list[float | None] | None] = [None] * len(entries)
        top_logprobs: list[list[list[tuple[int, float]] | None] | None] = [None] * len(entries)
        for i, (e, end) in enumerate(zip(entries, row_ends)):
            if e.want_prompt_logprobs:
                # A first prefill: the new tokens are the whole prompt, from position 0.
                assert e.num_cached == 0 and e.params is not None and e.params.prompt_logprobs is not None
                logprobs[i], top_logprobs[i] = prompt_logprobs(
                    logits[end - len(e.token_ids) : end], e.token_ids, e.params.prompt_logprobs
                )
        return logprobs, top_logprobs

    def _free_kv(self, req_id: int) -> None:
        row = self.req_rows.pop(req_id, None)
        if row is not None:
            self.model.req_manager.free_req(row)


def _per_entry(entries: list[BatchEntry], result: SampleResult | None) -> tuple[list, list, list]:
    """The sampler's results spread back over all entries, None where an entry did not sample."""
    token_ids: list[int | None] = [None] * len(entries)
    logprobs: list[float | None] = [None] * len(entries)
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * len(entries)
    rows = [i for i, e in enumerate(entries) if e.sample]
    for n, i in enumerate(rows):
        token_ids[i], logprobs[i], top_logprobs[i] = result.token_ids[n], result.logprobs[n], result.top_logprobs[n]
    return token_ids, logprobs, top_logprobs


class ModelRpcServer(rpyc.Service):
    """The rpyc face of a ModelWorker: bytes in, bytes out."""

    worker: ModelWorker | None = None

    def exposed_init_model(self, args: bytes) -> bytes:
        self.worker = ModelWorker(pickle.loads(args))
        return pickle.dumps(self.worker.info())

    def exposed_step(self, step: bytes) -> bytes:
        return pickle.dumps(self.worker.step(pickle.loads(step)))


def _serve(socket_path: str) -> None:
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    server = ThreadedServer(ModelRpcServer(), socket_path=socket_path, protocol_config=RPYC_CONFIG)
    server.start()


def _exit_when_orphaned(parent_pid: int) -> None:
    """A worker outlives its router only by accident (the router was killed): then leave too,
    rather than hold a GPU and a socket forever."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _start_worker_process(socket_path: str) -> subprocess.Popen:
    # A fresh interpreter (not multiprocessing's spawn), so the parent's __main__ is never
    # re-imported: scripts using LLM need no `if __name__ == "__main__"` guard.
    return subprocess.Popen([sys.executable, "-m", "llmserve.server.router.model_rpc", socket_path], stdin=subprocess.DEVNULL)


class ModelRpcClient:
    """Handle on one worker process."""

    def __init__(self, proc: subprocess.Popen, conn: rpyc.Connection):
        self.proc = proc
        self.conn = conn
        self._init_model = rpyc.async_(conn.root.init_model)
        self._step = rpyc.async_(conn.root.step)

    def init_model(self, args: WorkerInitArgs):
        return self._init_model(pickle.dumps(args))

    def step(self, step: StepInput):
        return self._step(pickle.dumps(step))

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ModelWorkerGroup:
    """All ranks of one model, stepped together."""

    def __init__(self, args: list[WorkerInitArgs]):
        self._tmpdir = tempfile.TemporaryDirectory(prefix="llmserve-")
        self.clients: list[ModelRpcClient] = []
        try:
            for a in args:
                path = os.path.join(self._tmpdir.name, f"rank{a.tp_rank}.sock")
                proc = _start_worker_process(path)
                self.clients.append(ModelRpcClient(proc, _connect(path, proc)))
            infos = self._gather([c.init_model(a) for c, a in zip(self.clients, args)])
            self.info: WorkerInfo = infos[0]
        except BaseException:
            self.close()
            raise

    def step(self, step: StepInput) -> StepOutput | None:
        return self._gather([c.step(step) for c in self.clients])[0]

    def _gather(self, results: list) -> list:
        out = []
        for rank, r in enumerate(results):
            try:
                out.append(pickle.loads(r.value))
            except EOFError as e:
                raise WorkerError(f"model worker rank {rank} died (exit code {self.clients[rank].proc.poll()})") from e
            except Exception as e:
                raise _as_local_error(e) from None
        return out

    def alive(self) -> bool:
        return all(c.proc.poll() is None for c in self.clients)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.clients = []
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


def _connect(path: str, proc: subprocess.Popen, timeout: float = 60.0) -> rpyc.Connection:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return unix_connect(path, config=RPYC_CONFIG)
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


if __name__ == "__main__":
    # Run from the imported module, not this __main__ copy, so pickled classes keep their real
    # module path on the way back to the router.
    from llmserve.server.router import model_rpc

    model_rpc._serve(sys.argv[1])
