"""What goes wrong in a worker beyond one request: telling a broken device from a request's own
failure, and the faults a test can ask a worker to have.

A request's failure (parameters the sampler cannot use, rows a kernel rejects, memory its batch
cannot get) ends that request, and the worker goes on. A failure of the device or of its
collectives does not depend on the input: a CUDA error such as an illegal memory access or a
device-side assert poisons the whole CUDA context, so every later step would fail too, and a
collective that failed leaves the ranks out of step. Such a failure is the worker's
(``is_device_failure``): it ends the engine, as a worker's death does.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

# Words of the messages of CUDA, NCCL, cuDNN, cuBLAS and Triton's launcher when the device (not
# the input) failed. A sticky CUDA error reappears in every later CUDA call, whichever raises it.
_DEVICE_FAILURE_WORDS = (
    "CUDA error", "CUDA driver error", "Triton Error [CUDA]", "illegal memory access", "device-side assert",
    "unspecified launch failure", "misaligned address", "illegal instruction", "NCCL", "cuDNN error",
    "CUDNN_STATUS_", "CUBLAS_STATUS_",
)


def _device_error_types() -> tuple[type[BaseException], ...]:
    types = [torch.cuda.CudaError]
    # torch.AcceleratorError: what torch raises on a CUDA error since 2.8 (a RuntimeError before).
    if hasattr(torch, "AcceleratorError"):
        types.append(torch.AcceleratorError)
    if torch.distributed.is_available():
        types.append(torch.distributed.DistBackendError)   # a collective failed (NCCL, gloo)
    return tuple(types)


def is_device_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is the device's or a collective's
    failure rather than one request's. Running out of memory is not: a smaller batch may fit."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.OutOfMemoryError):
            return False
        if isinstance(error, _device_error_types()) or any(word in str(error) for word in _DEVICE_FAILURE_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


# -- faults on demand, for tests -------------------------------------------------------------

FAULTS_VAR = "LLMSERVE_TEST_WORKER_FAULT"


@dataclass(frozen=True)
class InjectedFaults:
    """The faults a test asks a worker for in ``LLMSERVE_TEST_WORKER_FAULT``: comma-separated
    ``name=value`` pairs of the fields below (say ``slow_step=1,slow_start=5``). Tests only: the
    variable is read by the worker and nowhere else, and unset means no fault."""
    # Seconds the start-up sleeps once the model is loaded: a slow first compile or CUDA-graph
    # capture, which no step deadline covers.
    slow_start: float = 0.0
    # Seconds every forward sleeps first: a slow step that is not a hung one.
    slow_step: float = 0.0
    # The forward of this number (1 for the first) first launches a kernel that stores far out
    # of bounds on the device (an illegal memory access). On the CPU, which has no device to
    # fault, it raises the error a CUDA device would instead.
    device_fault: int = 0

    @classmethod
    def from_environ(cls) -> InjectedFaults:
        spec = os.environ.get(FAULTS_VAR, "").strip()
        if not spec:
            return cls()
        types = {f.name: float if f.type == "float" else int for f in fields(cls)}
        values = {}
        for item in spec.split(","):
            name, _, value = item.partition("=")
            if name.strip() not in types:
                raise ValueError(f"{FAULTS_VAR}: unknown fault {name.strip()!r} (known: {', '.join(types)})")
            values[name.strip()] = types[name.strip()](value)
        return cls(**values)

    def install(self, model) -> None:
        """Sleep the start-up's delay, and make ``model.forward`` slow or faulty as asked."""
        time.sleep(self.slow_start)
        if self.slow_step or self.device_fault:
            model.forward = self._faulty(model.forward, model.device)

    def _faulty(self, forward: Callable, device: torch.device) -> Callable:
        calls = itertools.count(1)

        def faulty_forward(*args, **kwargs):
            time.sleep(self.slow_step)
            if next(calls) == self.device_fault:
                store_out_of_bounds(device)
            return forward(*args, **kwargs)

        return faulty_forward


def store_out_of_bounds(device: torch.device) -> None:
    """Launch a kernel whose pointer is far past its buffer, and wait for it: the CUDA error it
    raises poisons the context, as a buggy kernel's would (tests only)."""
    if device.type != "cuda":
        raise RuntimeError("CUDA error: an illegal memory access was encountered "
                           f"(simulated on the CPU: {FAULTS_VAR} device_fault)")
    buffer = torch.zeros(1, device=device)
    _store_far[(1,)](buffer, 1 << 40)    # 4 TiB past a 4-byte buffer: no allocation is there
    torch.cuda.synchronize(device)       # the error surfaces here, in this forward, not at a later sync


@triton.jit
def _store_far(ptr, offset):
    tl.store(ptr + offset, 1.0)
