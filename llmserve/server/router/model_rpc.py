"""Model workers: one process per tensor-parallel rank, driven over rpyc.

Every step the router sends all ranks the same batch description; each rank runs its share of
the forward (the collectives inside line them up), and rank 0 samples and returns the ids.
Messages are pickled dataclasses sent as bytes, which keeps rpyc's proxies out of the hot path.

A failure tied to some entries of a step (bad sampling parameters, a forward that raises) is
reported in ``StepOutput.errors``, and the worker stays usable; anything a worker raises
instead is a ``WorkerError``, like its death: its state is then unknown, and the engine stops.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import rpyc
import torch
from rpyc.utils.factory import unix_connect
from rpyc.utils.server import ThreadedServer

from llmserve.sampling_params import SamplingParams
from llmserve.server.router.request import error_line

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
    # Per entry; None where the entry did not sample (a chunk of a prompt that continues) or failed.
    token_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    # Per entry: None unless it had want_prompt_logprobs; see sampler.prompt_logprobs.
    prompt_logprobs: list[list[float | None] | None]
    prompt_top_logprobs: list[list[list[tuple[int, float]] | None] | None]
    # Per entry: None, or why it failed (its request must end with that error).
    errors: list[str | None]
    # The forward raised, so every entry has that error, though maybe only one caused it. The
    # worker has undone the step (the KV slots it took), so the entries can run again, fewer
    # at a time, to find out which.
    forward_failed: bool = False

    @classmethod
    def failed_forward(cls, num_entries: int, error: str) -> StepOutput:
        def nones() -> list:
            return [None] * num_entries

        return cls(nones(), nones(), nones(), nones(), nones(), [error] * num_entries, forward_failed=True)

    @classmethod
    def concat(cls, parts: list[StepOutput]) -> StepOutput:
        """The outputs of consecutive slices of one batch, as one output of the whole batch."""
        return cls(*(sum((getattr(p, name) for p in parts), []) for name in (
            "token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "errors")))


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

        rows = [self._row(e.req_id) for e in step.entries]
        # Entries whose sampling setup failed still run the forward: every rank must run the
        # same batch (only rank 0 has a sampler), and their rows harm no one.
        errors = self._add_to_sampler(step.entries)
        input_ids = torch.tensor([t for e in step.entries for t in e.token_ids], dtype=torch.int64)
        q_lens = [len(e.token_ids) for e in step.entries]
        # The same flag on every rank: the lm_head's all-gather is a collective.
        all_logits = [e.want_prompt_logprobs for e in step.entries]
        try:
            logits = self.model.forward(input_ids, rows, [e.num_cached for e in step.entries], q_lens,
                                        return_all_logits=all_logits)
        except Exception as e:
            return self._forward_failed(step.entries, rows, e)
        if self.sampler is None:
            return None
        # An asking entry has one row of logits per new token, the others one, entries back to back.
        row_ends = list(itertools.accumulate(q if flag else 1 for q, flag in zip(q_lens, all_logits)))
        prompt_lps, prompt_tops = self._prompt_logprobs(logits, step.entries, row_ends, errors)
        sampling = [i for i, e in enumerate(step.entries) if e.sample and errors[i] is None]
        if sampling and row_ends[-1] != len(sampling):
            # Keep the last row of each entry that samples. (The common step, one row per entry
            # and all sampling, skips this.)
            last_rows = [row_ends[i] - 1 for i in sampling]
            logits = logits[torch.tensor(last_rows, dtype=torch.long, device=logits.device)]
        result = self.sampler.sample(logits, [step.entries[i].req_id for i in sampling]) if sampling else None
        return StepOutput(*_per_entry(len(step.entries), sampling, result, errors), prompt_lps, prompt_tops, errors)

    def _row(self, req_id: int) -> int:
        """The request's row of the req -> token table, taken on its first step."""
        if req_id not in self.req_rows:
            self.req_rows[req_id] = self.model.req_manager.alloc_req()
        return self.req_rows[req_id]

    def _add_to_sampler(self, entries: list[BatchEntry]) -> list[str | None]:
        """Start sampling the entries that bring their parameters; per entry, None or why that failed."""
        errors: list[str | None] = [None] * len(entries)
        for i, e in enumerate(entries):
            if e.params is not None and self.sampler is not None:
                try:
                    self.sampler.add_request(e.req_id, e.params, e.prompt_token_ids or [])
                except Exception as err:
                    errors[i] = error_line(err)
        return errors

    def _forward_failed(self, entries: list[BatchEntry], rows: list[int], error: Exception) -> StepOutput:
        """Undo the step (free the KV slots the forward took) and say so; the router finds the culprit."""
        if self.args.world_size > 1:
            # This rank may have left the forward before a collective the others now wait in: the
            # ranks can never be in step again. Dying is how the router (and the other ranks, whose
            # collective then fails) learn it, rather than waiting forever.
            logger.exception("rank %d: the forward failed; the ranks are out of step, exiting", self.args.tp_rank)
            os._exit(1)
        logger.warning("the forward of a batch of %d failed: %s", len(entries), error, exc_info=error)
        for e, row in zip(entries, rows):
            if self.model.req_manager.seq_len(row) > e.num_cached:
                self.model.req_manager.truncate(row, e.num_cached)
        return StepOutput.failed_forward(len(entries), error_line(error))

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, entries: list[BatchEntry], row_ends: list[int],
                         errors: list[str | None]) -> tuple[list, list]:
        """Per entry, its prompt logprobs, or None if it did not ask; entry i's rows of ``logits``
        end at ``row_ends[i]``. An entry for which that fails gets its error in ``errors``."""
        from llmserve.server.router.sampler import prompt_logprobs

        logprobs: list[list[float | None] | None] = [None] * len(entries)
        top_logprobs: list[list[list[tuple[int, float]] | None] | None] = [None] * len(entries)
        for i, (e, end) in enumerate(zip(entries, row_ends)):
            if e.want_prompt_logprobs and errors[i] is None:
                # A first prefill: the new tokens are the whole prompt, from position 0.
                assert e.num_cached == 0 and e.params is not None and e.params.prompt_logprobs is not None
                try:
                    logprobs[i], top_logprobs[i] = prompt_logprobs(
                        logits[end - len(e.token_ids) : end], e.token_ids, e.params.prompt_logprobs
                    )
                except Exception as err:
                    errors[i] = error_line(err)
        return logprobs, top_logprobs

    def _free_kv(self, req_id: int) -> None:
        row = self.req_rows.pop(req_id, None)
        if row is not None:
            self.model.req_manager.free_req(row)


def _per_entry(num_entries: int, sampled: list[int], result: SampleResult | None,
               errors: list[str | None]) -> tuple[list, list, list]:
    """The sampler's results (row n for entry ``sampled[n]``) spread back over all entries, None
    where an entry did not sample; a row the sampler failed on sets its entry's error."""
    token_ids: list[int | None] = [None] * num_entries
    logprobs: list[float | None] = [None] * num_entries
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * num_entries
    for n, i in enumerate(sampled):
        token_ids[i], logprobs[i], top_logprobs[i] = result.token_ids[n], result.logprobs[n], result.top_logprobs[n]
        errors[i] = errors[i] or result.errors[n]
    return token_ids, logprobs, top_logprobs


class ModelRpcServer(rpyc.Service):
    """The rpyc face of a ModelWorker: bytes in, bytes out."""

    worker: ModelWorker | None = None

    def exposed_init_model(self, args: bytes) -> bytes:
        self.worker = ModelWorker(pickle.loads(args))
        return pickle.dumps(self.worker.info())

    def exposed_step(self, step: bytes) -> bytes:
        return pickle.dumps(self.worker.step(pickle.loads(step)))


# Linux names sockets in an abstract namespace (no file: the name goes with the last socket
# using it, however its process dies). Addresses there are written "@name", as ss(8) does,
# since a command line cannot carry the real leading NUL.
_ABSTRACT_SOCKETS = sys.platform.startswith("linux")


def _socket_path(address: str) -> str:
    return "\0" + address[1:] if address.startswith("@") else address


def serve(address: str) -> None:
    """A worker process's life (see worker_main): serve the router until it closes us."""
    server = ThreadedServer(ModelRpcServer(), socket_path=_socket_path(address), protocol_config=RPYC_CONFIG)
    server.start()


def _start_worker_process(address: str) -> subprocess.Popen:
    # A fresh interpreter (not multiprocessing's spawn), so the parent's __main__ is never
    # re-imported: scripts using LLM need no `if __name__ == "__main__"` guard.
    return subprocess.Popen([sys.executable, "-m", "llmserve.server.router.worker_main", address, str(os.getpid())],
                            stdin=subprocess.DEVNULL)


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
        # Elsewhere than on Linux, socket files in a directory removed on close (a killed router
        # leaves them behind there).
        self._tmpdir = None if _ABSTRACT_SOCKETS else tempfile.TemporaryDirectory(prefix="llmserve-")
        # The router's PID in the name tells whose workers these are (ss -xlp; tests look for it).
        prefix = f"@llmserve-{os.getpid()}-{secrets.token_hex(4)}-" if self._tmpdir is None else self._tmpdir.name + "/"
        self.clients: list[ModelRpcClient] = []
        try:
            for a in args:
                address = f"{prefix}rank{a.tp_rank}.sock"
                proc = _start_worker_process(address)
                self.clients.append(ModelRpcClient(proc, _connect(address, proc)))
            infos = self._gather([c.init_model(a) for c, a in zip(self.clients, args)])
            self.info: WorkerInfo = infos[0]
        except BaseException:
            self.close()
            raise

    def step(self, step: StepInput) -> StepOutput | None:
        try:
            return self._gather([c.step(step) for c in self.clients])[0]
        except WorkerError:
            raise
        except Exception as e:
            # A worker reports its requests' own failures in StepOutput; what it raises instead
            # leaves its state (KV cache, rows, sampler) unknown.
            raise WorkerError(f"a model worker's step failed: {e}") from e

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
            return unix_connect(_socket_path(address), config=RPYC_CONFIG)
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

