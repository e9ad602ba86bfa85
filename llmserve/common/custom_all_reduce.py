"""The all-reduce of small tensor-parallel messages, over peer-to-peer buffers (issue 34).

Why: each layer of a decode step ends its two row-parallel projections with an all-reduce of
``[batch, hidden]`` (Llama-3-8B at batch 1: 8 KB in bf16). NCCL takes 15-25 us for one, so 64 of
them a step cost more than the half of the weights that a second GPU saves reading.

How: torch's symmetric memory (``torch.distributed._symmetric_memory``). Every rank allocates one
buffer at start-up, mapped into every peer's address space, and the ranks exchange the mappings
once (``rendezvous``), before any CUDA graph is captured; from then on a kernel of one rank loads
from its peers' buffers directly over NVLink, with no host work and nothing a graph cannot hold.

- **one-shot** (``symm_mem.one_shot_all_reduce_copy_out``): one kernel copies the local tensor
  into this rank's buffer, meets its peers at a barrier (flags in the signal pads), reads every
  rank's buffer, sums and writes the sum back over the local tensor, then meets them again, so
  that no rank writes its buffer while a peer still reads it. Each rank reads (N - 1) x the
  message: the fewest steps, for the messages whose cost is latency.
- **two-shot** (``symm_mem.two_shot_all_reduce_out``): the tensor is copied into the buffer; rank r
  sums the r-th 1/N of every buffer into its own, and after a barrier gathers the others' sums:
  less traffic per rank, for medium messages (world sizes 2, 4, 8 only).
- NCCL above ``TWO_SHOT_MAX_BYTES``, for a dtype the kernels do not take (fp16: they take bf16 and
  fp32) and for a tensor whose start or size is not a multiple of 16 bytes.

Sum order: both kernels add rank 0's values, then rank 1's, and so on, in the tensor's dtype (a bf16
sum is rounded after each addition), in the same order on every rank, so that every rank gets the
same bits. At world size 2 that equals NCCL's sum exactly (one rounding of a + b); at 4 and more
NCCL adds in another order, and the two agree to bf16 rounding.

- **fused with the residual add and norm** (`kernels/all_reduce_add_rmsnorm.py`, our own kernel):
  where a layer's row-parallel output goes straight into a residual add and an RMSNorm (every
  Llama-shaped layer, twice; Gemma 2 and 3 with the output's own norm before the add), one launch pushes this rank's addend into its peers' buffers,
  waits for theirs once, sums, adds and normalises. It has buffers of its own (two halves of
  ``world x`` its largest message, and flags), and takes messages up to `fused_max_bytes` (1 MiB at
  two GPUs, 512 KiB at more);
  ``LLMSERVE_FUSED_ALL_REDUCE=0`` turns it off (the benchmark's A/B), ``=one-way`` runs its
  flagless protocol (the data is the signal: the kernel's docstring), ``=one-way-push`` that and a
  batch-1 decode step's o and down GEMVs pushing their rows themselves (`push_target`), both
  opt-in until the GPUs have measured them.

NVLink multicast (the ``multimem_*`` ops, NVLS) is never used, and ``TORCH_SYMM_MEM_DISABLE_MULTICAST``
is set before the buffer is allocated, so that torch does not create a multicast object either:
on the shared GPU hosts multicast must stay off.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch
import torch.distributed as dist

from llmserve.kernels.all_reduce_add_rmsnorm import PROGRAMS, PushTarget, all_reduce_add_rmsnorm_triton

logger = logging.getLogger(__name__)

Algorithm = Literal["one_shot", "two_shot", "nccl"]

# Where one-shot stops paying and two-shot starts, and where NCCL takes over: vLLM's custom
# all-reduce and SGLang's use one-stage kernels up to about 512 KiB on NVLink and their own up to
# 8 MiB. To be tuned from benchmarks/all_reduce.py's table on the H100/H200 hosts.
ONE_SHOT_MAX_BYTES = 512 << 10
TWO_SHOT_MAX_BYTES = 8 << 20
# The largest message the fused all-reduce + add + norm takes (larger ones: all-reduce, then
# add_rmsnorm), from all_reduce.py's fused column against +norm (2 and 4 H200s, 2026-11-28, us in a
# CUDA graph): at 2 GPUs the fused kernel wins up to 1 MiB (13.0 against 18.4 there: a decode batch
# of 128 rows of 4096) and ties at 2 MiB; at 4 it wins up to 512 KiB (13.5 / 15.8) and loses at
# 1 MiB (22.5 / 19.9). More GPUs: 4's, unmeasured.
FUSED_MAX_BYTES = ONE_SHOT_MAX_BYTES
FUSED_MAX_BYTES_BY_WORLD = {2: 1 << 20}


def fused_max_bytes(world_size: int) -> int:
    """The largest message the fused kernel takes at this world size."""
    return FUSED_MAX_BYTES_BY_WORLD.get(world_size, FUSED_MAX_BYTES)
TWO_SHOT_WORLD_SIZES = (2, 4, 8)    # the world sizes two_shot_all_reduce_out is compiled for
DTYPES = (torch.bfloat16, torch.float32)   # what the symm_mem kernels dispatch on
ALIGNMENT = 16                      # bytes: the kernels' vector width, for start and size alike
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)   # what the fused kernel takes
# "0": all-reduce, then add_rmsnorm (two launches); "one-way": the fused kernel without flags
FUSED_ENV_VAR = "LLMSERVE_FUSED_ALL_REDUCE"


def algorithm_for(nbytes: int, dtype: torch.dtype, world_size: int, one_shot_max: int = ONE_SHOT_MAX_BYTES,
                  two_shot_max: int = TWO_SHOT_MAX_BYTES) -> Algorithm:
    """Which all-reduce a contiguous message of ``nbytes`` bytes, 16-byte aligned at its start, gets."""
    if dtype not in DTYPES or nbytes == 0 or nbytes % ALIGNMENT:
        return "nccl"
    if nbytes <= one_shot_max:
        return "one_shot"
    # Two-shot hands each rank 1/N of the message: only where every share is whole 16-byte vectors
    # (any decode message of a hidden size divisible by 64 is).
    if nbytes <= two_shot_max and world_size in TWO_SHOT_WORLD_SIZES and nbytes % (ALIGNMENT * world_size) == 0:
        return "two_shot"
    return "nccl"


def human_bytes(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


class CustomAllReduce:
    """One process group's symmetric buffer and the kernels over it. Build it on every rank of the
    group at once (``setup``: its rendezvous is a collective), before any CUDA graph is captured."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, one_shot_max: int = ONE_SHOT_MAX_BYTES,
                 two_shot_max: int = TWO_SHOT_MAX_BYTES, fused_max: int | None = None):
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"   # before the first allocation: see the module's docstring
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.rank, self.world_size = group.rank(), group.size()
        self.one_shot_max = one_shot_max
        self.fused_max = fused_max if fused_max is not None else fused_max_bytes(self.world_size)
        self.two_shot_max = two_shot_max if self.world_size in TWO_SHOT_WORLD_SIZES else 0
        # The two ops looked up now, so that a torch without them fails here, not in the first step.
        self._one_shot = torch.ops.symm_mem.one_shot_all_reduce_copy_out
        self._two_shot = torch.ops.symm_mem.two_shot_all_reduce_out
        # The allocation backend is left at torch's default for CUDA (its own peer-to-peer mappings
        # of CUDA virtual memory): asking for it by name with set_backend("CUDA") fails on torch 2.11
        # ("does not find allocation backend CUDA", seen on two H200s; pytorch/pytorch#160289).
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not hasattr(enable, "__deprecated__"):
            enable(self.group_name)   # torch before 2.10 wants it; later ones deprecate it
        # One buffer for every message: each kernel's closing barrier frees it for the next one.
        self.buffer = symm_mem.empty(max(one_shot_max, self.two_shot_max), dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self._views = {dtype: self.buffer.view(dtype) for dtype in DTYPES}
        fused = os.environ.get(FUSED_ENV_VAR, "1").strip()
        self.fuses_add_rmsnorm = fused != "0"
        self.one_way = fused in ("one-way", "one-way-push")
        self.pushes = fused == "one-way-push"   # batch-1 o / down GEMVs push their rows (push_target)
        if self.fuses_add_rmsnorm:
            self._setup_fused(symm_mem, group, device)

    def _setup_fused(self, symm_mem, group: dist.ProcessGroup, device: torch.device) -> None:
        """The fused kernel's buffers: every rank's mapped into every other's, the flags zeroed (one
        way: the buffer emptied) on every rank before any rank can write into them (the closing
        all-reduce is a barrier)."""
        fused = symm_mem.empty(2 * self.world_size * self.fused_max, dtype=torch.uint8, device=device)
        self._fused_ptrs = _peer_pointers(symm_mem.rendezvous(fused, self.group_name), device)
        if self.one_way:                        # every byte 0xFF: "empty"; no flags
            fused.fill_(0xFF)
            self._flag_ptrs, self._fused_buffers = None, (fused,)
        else:
            flags = symm_mem.empty(PROGRAMS * self.world_size, dtype=torch.int64, device=device)
            flags.zero_()
            self._flag_ptrs = _peer_pointers(symm_mem.rendezvous(flags, self.group_name), device)
            self._fused_buffers = (fused, flags)   # kept alive: the pointers above are all the kernel holds
        self._epochs = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.all_reduce(torch.zeros(1, device=device), group=group)

    @classmethod
    def setup(cls, group: dist.ProcessGroup, device: torch.device, **thresholds: int) -> CustomAllReduce | None:
        """Every rank of ``group``: the custom all-reduce, or None, on every rank alike, where a rank
        cannot set it up (no peer-to-peer access, a torch without the ops, a failed rendezvous) or
        its first sums are wrong; the rank that failed says why in one log line."""
        try:
            reason = _unusable(device, group.size())
        except Exception as e:   # whatever this rank cannot ask, it must still answer the agreement below
            reason = f"{type(e).__name__}: {e}".splitlines()[0]
        ours = None
        # Agreed before the rendezvous, which every rank must enter (a rank whose allocation fails
        # after that leaves the others waiting in it: not seen, but not guarded against either).
        if _all_ranks_agree(reason is None, device, group):
            try:
                ours = cls(group, device, **thresholds)
                reason = ours._check()
            except Exception as e:   # an allocation or the rendezvous failed: this rank says why
                reason = f"{type(e).__name__}: {e}".splitlines()[0]
        if not _all_ranks_agree(reason is None, device, group):
            if reason is not None:
                logger.warning("custom all-reduce unavailable (%s): NCCL's all-reduce is used", reason)
            return None
        return ours

    def algorithm(self, t: torch.Tensor) -> Algorithm:
        if not t.is_contiguous() or (t.storage_offset() * t.element_size()) % ALIGNMENT:
            return "nccl"
        return algorithm_for(t.numel() * t.element_size(), t.dtype, self.world_size, self.one_shot_max,
                             self.two_shot_max)

    def all_reduce(self, t: torch.Tensor, algorithm: Algorithm) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place, with ``algorithm`` (``self.algorithm(t)``, or a forced
        one for the benchmark and the tests: either kernel takes any message that fits the buffer)."""
        flat = t.view(-1)
        buffer = self._views[t.dtype][: t.numel()]
        if algorithm == "one_shot":
            self._one_shot(buffer, flat, "sum", self.group_name, flat)
        elif algorithm == "two_shot":
            buffer.copy_(flat)
            self._two_shot(buffer, "sum", self.group_name, flat)
        else:
            raise ValueError(f"not a custom all-reduce algorithm: {algorithm!r}")
        return t

    def takes_add_rmsnorm(self, addend: torch.Tensor) -> bool:
        """Whether ``all_reduce_add_rmsnorm`` takes this addend (else: all-reduce, then add_rmsnorm)."""
        return addend.is_contiguous() and self._fuses(addend.dtype, addend.numel())

    def _fuses(self, dtype: torch.dtype, numel: int) -> bool:
        """Whether the fused kernel takes a contiguous addend of ``numel`` values of ``dtype``."""
        return self.fuses_add_rmsnorm and dtype in FUSED_DTYPES and 0 < numel * dtype.itemsize <= self.fused_max

    def all_reduce_add_rmsnorm(self, addend: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                               round_first: bool, delta_weight: torch.Tensor | None = None,
                               pushed: bool = False) -> torch.Tensor:
        """``h += the sum of addend over the ranks`` in place (with ``delta_weight``: the sum's
        RMSNorm), then RMSNorm of h: one launch (`kernels/all_reduce_add_rmsnorm.py`); for an
        addend ``takes_add_rmsnorm`` takes. ``pushed``: its producer pushed it (`push_target`)."""
        return all_reduce_add_rmsnorm_triton(addend, h, weight, eps, round_first, self._fused_ptrs, self._flag_ptrs,
                                             self._epochs, self.rank, self.fused_max // addend.element_size(),
                                             delta_weight, pushed)

    def push_target(self, dtype: torch.dtype, n: int) -> PushTarget | None:
        """Where a one-row producer of an addend of ``n`` values of ``dtype`` stores it for the
        fused kernel's next call (``LLMSERVE_FUSED_ALL_REDUCE=one-way-push``), or None."""
        if not self.pushes or not self._fuses(dtype, n):
            return None
        return PushTarget(self._fused_ptrs, self._epochs, self.rank, self.fused_max // dtype.itemsize)

    def describe(self) -> str:
        two_shot = f", two-shot up to {human_bytes(self.two_shot_max)}" if self.two_shot_max > self.one_shot_max else ""
        fused = (f", fused with the residual add and norm up to {human_bytes(self.fused_max)}"
                 + (" (one-way" + (", batch-1 GEMVs pushing" if self.pushes else "") + ")" if self.one_way else "")
                 if self.fuses_add_rmsnorm else "")
        return (f"custom (symmetric memory, bf16/fp32: one-shot up to {human_bytes(self.one_shot_max)}{two_shot}, "
                f"NCCL above{fused})")

    def _check(self) -> str | None:
        """Sum small integers, whose bf16 sum is exact, with each kernel; what went wrong, or None."""
        expected = self.world_size * (self.world_size + 1) // 2
        for algorithm in ("one_shot", "two_shot") if self.two_shot_max else ("one_shot",):
            t = torch.full((4096,), self.rank + 1, dtype=torch.bfloat16, device=self.buffer.device)
            self.all_reduce(t, algorithm)
            if not bool((t == expected).all()):
                return f"its {algorithm} sum was wrong in a self-check"
        if self.fuses_add_rmsnorm:
            addend = torch.full((3, 64), self.rank + 1, dtype=torch.bfloat16, device=self.buffer.device)
            h = torch.ones_like(addend)
            self.all_reduce_add_rmsnorm(addend, h, torch.ones(64, dtype=torch.bfloat16, device=h.device), 1e-6, True)
            if not bool((h == expected + 1).all()):
                return "its fused all-reduce + add + norm was wrong in a self-check"
        return None


def _peer_pointers(handle, device: torch.device) -> torch.Tensor:
    """Every rank's copy of a rendezvoused buffer, as this process addresses it (int64 [world])."""
    return torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)


def _unusable(device: torch.device, world_size: int) -> str | None:
    """Why this rank cannot join a custom all-reduce, from what it can tell alone."""
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy_out"
    # The ranks of one node hold GPUs 0 .. world_size - 1 (ModelWorker: cuda:local_rank).
    blocked = [peer for peer in range(world_size)
               if peer != device.index and not torch.cuda.can_device_access_peer(device.index, peer)]
    if blocked:
        return f"GPU {device.index} has no peer-to-peer access to GPU{'s' * (len(blocked) > 1)} {blocked}"
    return None


def _all_ranks_agree(ok: bool, device: torch.device, group: dist.ProcessGroup) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (one NCCL all-reduce)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
