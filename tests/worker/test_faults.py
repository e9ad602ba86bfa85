"""Which failures are the device's (fatal: the engine stops) and which a request's own, and the
test-only faults a worker can be asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from llmserve.worker.faults import FAULTS_VAR, InjectedFaults, is_device_failure, store_out_of_bounds


def raised_from(cause: BaseException, error: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as c:
            raise error from c
    except BaseException as e:
        return e


DEVICE_FAILURES = {
    "illegal_memory_access": RuntimeError(
        "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported "
        "at some other API call, so the stacktrace below might be incorrect."),
    "device_side_assert": RuntimeError("CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`"),
    "accelerator_error": torch.AcceleratorError("CUDA error: unspecified launch failure"),
    "triton_launcher": RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
    "nccl": RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5"),
    "collective": torch.distributed.DistBackendError("[rank0] the communicator was aborted on rank 1"),
    "cublas": RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`"),
    "cudnn": RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
    # a sampler's own error type, raised while the device was failing
    "raised_from_one": raised_from(RuntimeError("CUDA error: misaligned address"), ValueError("the draw failed")),
}

REQUEST_FAILURES = {
    "out_of_memory": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)"),
    "top_k_overflows": OverflowError("Python int too large to convert to C long"),
    "index_out_of_range": IndexError("index 70000 is out of bounds for dimension 0 with size 49152"),
    "kernel_rejects_rows": RuntimeError("a kernel failed on these rows"),
    "bad_shape": RuntimeError("shape '[2, -1, 4]' is invalid for input of size 6"),
    "grammar": ValueError("the grammar does not accept token 17"),
}


@pytest.mark.parametrize("name", list(DEVICE_FAILURES))
def test_a_device_failure_is_the_workers(name):
    assert is_device_failure(DEVICE_FAILURES[name])


@pytest.mark.parametrize("name", list(REQUEST_FAILURES))
def test_a_requests_failure_stays_its_own(name):
    assert not is_device_failure(REQUEST_FAILURES[name])


def test_out_of_memory_raised_from_a_request_error_stays_the_requests():
    assert not is_device_failure(raised_from(IndexError("index 3 is out of bounds"),
                                             torch.OutOfMemoryError("CUDA out of memory.")))


def test_no_faults_unless_asked(monkeypatch):
    monkeypatch.delenv(FAULTS_VAR, raising=False)
    assert InjectedFaults.from_environ() == InjectedFaults()
    monkeypatch.setenv(FAULTS_VAR, "slow_start=2.5, slow_step=0.5,device_fault=3")
    assert InjectedFaults.from_environ() == InjectedFaults(slow_start=2.5, slow_step=0.5, device_fault=3)
    monkeypatch.setenv(FAULTS_VAR, "slow_steps=1")
    with pytest.raises(ValueError, match="unknown fault 'slow_steps'"):
        InjectedFaults.from_environ()


def test_the_forward_of_the_number_asked_faults_once():
    class Model:
        device = torch.device("cpu")

        def __init__(self):
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x + 1

    model = Model()
    InjectedFaults(device_fault=2).install(model)
    assert model.forward(1) == 2
    with pytest.raises(RuntimeError) as raised:
        model.forward(1)
    assert is_device_failure(raised.value)
    assert model.forward(1) == 2 and model.calls == 2     # the faulting forward never ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_an_out_of_bounds_store_is_a_device_failure():
    # In a process of its own: the error poisons the CUDA context of the process that meets it.
    code = """
import torch
from llmserve.worker.faults import is_device_failure, store_out_of_bounds
try:
    store_out_of_bounds(torch.device("cuda"))
except Exception as e:
    print(is_device_failure(e), repr(e).splitlines()[0])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.startswith("True "), out.stdout + out.stderr
