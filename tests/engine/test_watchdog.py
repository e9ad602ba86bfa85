"""When the engine cannot go on, it says so: a step that hangs past ``step_timeout`` and a failure
of the device end it with ``WorkerError``, while slow steps and a slow start do not. The offline
``LLM`` here; the server's side is tests/server/api/test_watchdog.py.

The workers are slowed or faulted through ``LLMSERVE_TEST_WORKER_FAULT`` (llmserve/worker/faults.py),
which they read as they start.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from llmserve import LLM, SamplingParams
from llmserve.worker.faults import FAULTS_VAR
from llmserve.worker.protocol import WorkerError
from serving_utils import pid_alive

STEP_TIMEOUT_S = 3.0
SLOW_STEP_S = 1.0                  # each step a third of the deadline...
SLOW_START_S = STEP_TIMEOUT_S + 1  # ...and a start-up longer than it
PREFILL_CHUNK = 16


def start_llm(model: str, faults: str, **options) -> LLM:
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FAULTS_VAR, faults)
        return LLM(model, step_timeout=STEP_TIMEOUT_S, max_total_token_num=2048, **options)


def worker_pid(llm: LLM) -> int:
    return llm.engine.workers.client.proc.pid


@pytest.fixture(scope="module")
def slow_llm(tiny_llama_dir):
    """The tiny model on a worker whose every step takes SLOW_STEP_S and whose start-up took
    SLOW_START_S; prompts prefilled PREFILL_CHUNK tokens a step."""
    started = time.monotonic()
    llm = start_llm(tiny_llama_dir, f"slow_start={SLOW_START_S},slow_step={SLOW_STEP_S}",
                    max_prefill_tokens=PREFILL_CHUNK)
    llm.start_seconds = time.monotonic() - started
    pid = worker_pid(llm)
    try:
        yield llm
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)     # a test that stopped it and failed
        llm.close()


def test_a_slow_start_and_slow_steps_do_not_trip_the_deadline(slow_llm):
    assert slow_llm.start_seconds > STEP_TIMEOUT_S
    prompt = list(range(100, 100 + 3 * PREFILL_CHUNK))     # a prefill of three steps
    started = time.monotonic()
    [out] = slow_llm.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    took = time.monotonic() - started
    assert out.finish_reason == "length" and len(out.token_ids) == 3, out
    assert took > STEP_TIMEOUT_S + SLOW_STEP_S     # five steps of a second: the deadline is a step's, not a request's


def test_a_stopped_worker_is_a_hung_step(slow_llm):
    """(After the test above, on the same engine: it ends it.)"""
    pid = worker_pid(slow_llm)
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 0 did not finish a step within {STEP_TIMEOUT_S:g} s"):
        slow_llm.generate(["Hello"], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert time.monotonic() - started < STEP_TIMEOUT_S + 5
    slow_llm.close()
    assert not pid_alive(pid), "the stopped worker was left behind"


def test_a_device_failure_ends_the_engine(tiny_llama_dir):
    """The worker's third forward meets an illegal memory access (on the CPU, its error raised by
    the fault hook): not one request's failure but the device's."""
    with start_llm(tiny_llama_dir, "device_fault=3") as llm:
        pid = worker_pid(llm)
        with pytest.raises(WorkerError, match=r"rank 0: the device failed \(RuntimeError: CUDA error: an illegal memory"):
            llm.generate(["Hello", "Once upon a time"], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert not pid_alive(pid)
