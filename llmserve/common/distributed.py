"""Tensor-parallel collectives, pipeline hand-offs, and where the ranks of one model meet.

Every collective helper is a no-op at world size 1, so model code calls them unconditionally
and single-rank runs never touch torch.distributed.

At ``pp`` > 1 the world is ``tp x pp`` ranks: rank r is tp rank ``r % tp`` of pipeline stage
``r // tp`` (a stage's ranks are contiguous, so that ``--nnodes pp`` puts one stage on each node).
The tensor-parallel collectives run in the stage's own group; the stages hand their hidden states
on with point-to-point sends (``PipelineLink``).

The ranks meet at torch.distributed's TCPStore, which rank 0 hosts at ``dist_init_addr`` (the
head's HOST:PORT): the other ranks, on this machine or on other nodes, connect to it, say they
joined, and read what to load from it (``Rendezvous``). From then on rank 0 is the only rank the
engine talks to: it hands every step to the others over a CPU (gloo) group (``StepChannel``).
"""

from __future__ import annotations

import datetime
import pickle
import socket
import struct
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmserve.common.custom_all_reduce import CustomAllReduce
from llmserve.kernels import add_rmsnorm_forward
from llmserve.kernels.gemv import gemv_triton, takes_gemv

# This process's custom all-reduce (GPUs of one node, see custom_all_reduce.py), or None: NCCL's
# or gloo's. Set once by init_distributed, before the model's first forward; read by every
# all_reduce after that, on the one thread that runs the model.
_custom_all_reduce: CustomAllReduce | None = None
_all_reduce_description = ""
# This rank's pipeline stage's tp ranks, or None: the whole world (pp = 1, or a test's own process
# group). Set once by init_distributed; read by the collectives below, on the thread of the model.
_tp_group: dist.ProcessGroup | None = None


def tp_size() -> int:
    """The ranks the tensor-parallel collectives run over: this stage's (1: none)."""
    return dist.get_world_size(_tp_group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` across the stage's tp ranks in place (row-parallel matmul outputs, vocab-parallel
    embeddings): with the custom all-reduce where it takes the message (a decode step's, on GPUs
    of one node), else the process group's own (NCCL, gloo)."""
    if tp_size() > 1:
        custom = _custom_all_reduce
        if custom is not None and (algorithm := custom.algorithm(t)) != "nccl":
            custom.all_reduce(t, algorithm)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_tp_group)
    return t


@dataclass(frozen=True)
class PartialSum:
    """A row-parallel projection's output before its all-reduce: this rank's addend of the sum
    over the stage's tp ranks. A layer leaves its output so only where a residual add and an
    RMSNorm come next (``TransformerLayerInferTpl.reduces_in_norm``): `add_rmsnorm` then sums it,
    in one kernel with the add and the norm where the custom all-reduce's fused kernel takes it.
    Any other consumer gets a reduced tensor (``reduce``), and fails loudly on this type."""

    addend: torch.Tensor
    # The addend's producer already stored it into the peers' buffers of the fused kernel's one-way
    # protocol (`row_parallel_gemv`): only that kernel may sum it, or the peers' buffers would be
    # left holding it.
    pushed: bool = False

    def __getitem__(self, rows) -> PartialSum:
        """Some rows of the sum (the post layer's logit rows): the sum of those rows' addends."""
        self._not_pushed()
        return PartialSum(self.addend[rows])

    def reduce(self) -> torch.Tensor:
        """The sum itself (in place over the addend)."""
        self._not_pushed()
        return all_reduce(self.addend)

    def _not_pushed(self) -> None:
        if self.pushed:
            raise RuntimeError("a pushed row-parallel output is summed whole, by the fused all-reduce")


def row_parallel_gemv(x: torch.Tensor, weight: torch.Tensor) -> PartialSum | None:
    """A decode step's one-row, row-parallel projection whose output goes into the fused
    all-reduce + add + norm (`add_rmsnorm`): run by a GEMV that also pushes the row into the
    peers' buffers (`CustomAllReduce.push_target`), so that the fused kernel only waits, sums and
    normalises. None where that does not apply (no one-way push, not a one-row GEMV): the caller
    runs its plain projection. Its caller guarantees that the whole output reaches `add_rmsnorm`."""
    custom = _custom_all_reduce                      # (only on GPUs)
    target = custom.push_target(x.dtype, weight.shape[0]) if custom is not None else None
    if target is None or not takes_gemv(x, weight):
        return None
    return PartialSum(gemv_triton(x, weight, push=target), pushed=True)


def add_rmsnorm(h: torch.Tensor, delta: torch.Tensor | PartialSum, weight: torch.Tensor, eps: float,
                round_first: bool = True, delta_weight: torch.Tensor | None = None) -> torch.Tensor:
    """`add_rmsnorm_forward` (``h += delta`` in place, or ``h += norm(delta)`` with ``delta_weight``,
    then the norm of h), where ``delta`` may still be a ``PartialSum``: summed over the ranks in
    the same kernel where the fused all-reduce takes it, else all-reduced first."""
    if isinstance(delta, PartialSum):
        custom = _custom_all_reduce
        if custom is not None and custom.takes_add_rmsnorm(delta.addend):
            return custom.all_reduce_add_rmsnorm(delta.addend, h, weight, eps, round_first, delta_weight,
                                                 pushed=delta.pushed)
        delta = delta.reduce()
    return add_rmsnorm_forward(h, delta, weight, eps, round_first, delta_weight)


def all_reduce_description() -> str:
    """Which all-reduce the ranks use, for the start-up line ("" at world size 1)."""
    return _all_reduce_description


def all_gather_last_dim(t: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's `t` along the last dimension (vocab-parallel logits)."""
    n = tp_size()
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=-1)


def init_distributed(store: dist.Store | None, rank: int, world: int, device: torch.device,
                     custom_all_reduce: bool = False, tp: int | None = None) -> None:
    """Join the process group through the rendezvous' store: NCCL between GPUs, gloo between CPU
    processes; with ``tp`` < ``world`` (pipeline stages of ``tp`` ranks each) make each stage's tp
    group. ``custom_all_reduce``: the GPUs are all on this node, and the small all-reduces may run
    over their peer-to-peer buffers instead of NCCL (every rank must pass the same)."""
    global _tp_group
    if world == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("model/", store), rank=rank, world_size=world)
    tp = tp or world
    if tp < world:
        # Every rank makes every stage's group, in the same order (new_group is collective).
        groups = [dist.new_group(list(range(start, start + tp))) for start in range(0, world, tp)]
        _tp_group = groups[rank // tp]
    if tp == 1:         # pipeline stages of one rank each: nothing to all-reduce
        set_custom_all_reduce(None, "")
    elif custom_all_reduce and backend == "nccl" and tp == world:   # not over a stage's group yet
        custom = CustomAllReduce.setup(dist.group.WORLD, device)
        set_custom_all_reduce(custom, None if custom else "NCCL (the custom all-reduce failed to start: see the log)")
    else:
        set_custom_all_reduce(None, backend.upper())


def reduce_over_ranks(values: list[int], op: str, device: torch.device) -> list[int]:
    """Each of ``values`` summed ("sum") or least ("min") over every rank of the world (the KV
    cache's size, which every rank must share; the weights' count); ``values`` at world size 1."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}[op])
    return t.tolist()


def set_custom_all_reduce(custom: CustomAllReduce | None, description: str | None = None) -> None:
    """Use ``custom`` for the all-reduces it takes from now on (None: the process group's own), and
    say so in ``description`` (default: custom's own); init_distributed's choice, which the
    all-reduce benchmark and the tests also toggle."""
    global _custom_all_reduce, _all_reduce_description
    _custom_all_reduce = custom
    _all_reduce_description = description if description is not None else (
        custom.describe() if custom is not None else "NCCL")


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"dist-init-addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


# Waiting for ever, as a timedelta: a follower waits on rank 0's next step however long the
# server idles, and learns of rank 0's end from its closed connection instead.
FOREVER = datetime.timedelta(days=365)


class Rendezvous:
    """The store the ranks of one model meet at, and what they tell each other there: who joined,
    what to load, who loaded, and the first failure of any rank (what ended it, in one line, for
    the head's error message)."""

    def __init__(self, store: dist.TCPStore):
        self.store = store

    @classmethod
    def host(cls, addr: str, world: int) -> Rendezvous:
        """Rank 0's: start the store at ``addr``."""
        host, port = split_addr(addr)
        try:
            store = dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False, timeout=FOREVER)
        except Exception as e:   # the port is taken, the address not this machine's
            raise RuntimeError(f"cannot host the ranks' rendezvous at {addr}: {e}") from None
        return cls(store)

    @classmethod
    def join(cls, addr: str, rank: int, timeout: float) -> Rendezvous:
        """Another rank's: connect to rank 0's store (waiting up to ``timeout`` for it to be up)
        and say so."""
        host, port = split_addr(addr)
        _wait_for_listener(host, port, timeout, addr)
        store = dist.TCPStore(host, port, is_master=False, timeout=_seconds(max(timeout, 60.0)))
        if rank >= 0:
            store.set(f"joined/{rank}", b"1")
        return cls(store)

    def wait_for(self, what: str, ranks: list[int], timeout: float | None) -> dict[int, bytes]:
        """Each rank's ``what`` key (``report``), waiting up to ``timeout`` (None: for ever) for all
        of them; ``MissingRanks`` after that, the reported failure if a rank fails first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        keys = [f"{what}/{r}" for r in ranks]
        while not self.store.check(keys):
            if (failure := self.failure()) is not None:
                raise RuntimeError(failure)
            if deadline is not None and time.monotonic() > deadline:
                raise MissingRanks([r for r, k in zip(ranks, keys) if not self.store.check([k])])
            time.sleep(0.05)
        return {r: self.store.get(k) for r, k in zip(ranks, keys)}

    def publish(self, key: str, value: object) -> None:
        self.store.set(key, pickle.dumps(value))

    def read(self, key: str) -> object:
        return pickle.loads(self.store.get(key))

    def report(self, rank: int, key: str, value: str) -> None:
        self.store.set(f"{key}/{rank}", value.encode())

    def fail(self, message: str) -> None:
        """Tell the head that a rank cannot go on; the first report wins."""
        self.store.compare_set("failed", b"", message.encode())

    def failure(self, wait: float = 0.0) -> str | None:
        """The first failure a rank or a node reported, if any, waiting up to ``wait`` seconds for one."""
        deadline = time.monotonic() + wait
        while not self.store.check(["failed"]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return self.store.get("failed").decode() or None


def _wait_for_listener(host: str, port: int, timeout: float, addr: str) -> None:
    """Wait until something listens at host:port. (TCPStore's own client retries with a backoff
    that grows to a minute, and logs each try as an error.)"""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the head's rendezvous at {addr} did not come up within {timeout:g} s") from None
            time.sleep(0.1)


class MissingRanks(RuntimeError):
    def __init__(self, ranks: list[int]):
        super().__init__(f"ranks {ranks} are missing")
        self.ranks = ranks


class StepChannel:
    """Rank 0 to the other ranks: each step's bytes (a pickled ``StepInput``), in one broadcast
    over a gloo group when they fit the buffer (the common step: a decode batch of a hundred
    requests is a few kB), two when they do not. One collective instead of an rpyc call per rank:
    the ranks run the same steps in the same order by construction."""

    _HEADER = struct.Struct("<q")

    def __init__(self, capacity: int = 16 << 10):
        # gloo whatever the model's backend: the bytes live on the host. No timeout: a rank waits
        # here while the server idles.
        self.group = dist.new_group(backend="gloo", timeout=FOREVER)
        self.capacity = capacity
        self.buffer = torch.zeros(self._HEADER.size + capacity, dtype=torch.uint8)

    def send(self, data: bytes) -> None:
        """Rank 0: hand ``data`` to every other rank (b"" ends their loops)."""
        head = data[: self.capacity]
        view = self.buffer.numpy()
        self._HEADER.pack_into(view, 0, len(data))
        view[self._HEADER.size : self._HEADER.size + len(head)] = memoryview(head)
        dist.broadcast(self.buffer, 0, group=self.group)
        if len(data) > self.capacity:
            dist.broadcast(torch.frombuffer(bytearray(data[self.capacity :]), dtype=torch.uint8), 0, group=self.group)

    def recv(self) -> bytes:
        """The other ranks: the next bytes rank 0 sends (raises once rank 0 is gone)."""
        dist.broadcast(self.buffer, 0, group=self.group)
        view = self.buffer.numpy()
        (size,) = self._HEADER.unpack_from(view, 0)
        head = view[self._HEADER.size : self._HEADER.size + min(size, self.capacity)].tobytes()
        if size <= self.capacity:
            return head
        rest = torch.empty(size - self.capacity, dtype=torch.uint8)
        dist.broadcast(rest, 0, group=self.group)
        return head + rest.numpy().tobytes()


class PipelineLink:
    """One rank's hand-offs between pipeline stages, point to point (NCCL between GPUs, gloo
    between CPU processes), each to the rank of the same tp index in the next stage: the residual
    stream ``(h, pending)`` from the stage before and to the stage after, and the last stage's
    logits to rank 0, which samples. The receiver knows every shape from the step itself, so
    only the tensors travel."""

    def __init__(self, rank: int, tp: int, pp: int):
        self.prev: int | None = rank - tp if rank >= tp else None        # None: stage 0
        self.next: int | None = rank + tp if rank + tp < tp * pp else None   # None: the last stage
        # The last stage's tp rank 0 hands the logits (all-gathered in its tp group) to rank 0.
        self.last_stage_rank0 = (pp - 1) * tp
        self.sends_logits = rank == self.last_stage_rank0
        self.receives_logits = rank == 0

    def send_hidden(self, h: torch.Tensor, pending: torch.Tensor) -> None:
        dist.send(h.contiguous(), self.next)
        dist.send(pending.contiguous(), self.next)

    def recv_hidden(self, shape: tuple[int, int], dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.empty(shape, dtype=dtype, device=device)
        pending = torch.empty(shape, dtype=dtype, device=device)
        self.recv_into(h, pending)
        return h, pending

    def recv_into(self, h: torch.Tensor, pending: torch.Tensor) -> None:
        """The stage before's output into ``h`` and ``pending`` (contiguous; a graph's static inputs)."""
        dist.recv(h, self.prev)
        dist.recv(pending, self.prev)

    def logits_to_rank0(self, logits: torch.Tensor | None, shape: tuple[int, int],
                        device: torch.device) -> torch.Tensor | None:
        """Rank 0: the step's logits (float32, ``shape``), from the last stage; that stage's tp
        rank 0 sends its own. Any other rank: None."""
        if self.sends_logits:
            dist.send(logits.contiguous(), 0)
        elif self.receives_logits:
            logits = torch.empty(shape, dtype=torch.float32, device=device)
            dist.recv(logits, self.last_stage_rank0)
            return logits
        return None
