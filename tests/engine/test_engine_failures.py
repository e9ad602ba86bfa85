"""A request that fails inside a step fails alone: the engine ends it with an error, the requests
beside it complete with exactly the output they get alone, and the engine keeps serving.

The poisons skip validation (``SamplingParams.verify()`` and ``check_request``): it stops them at
the edge, and these tests are about the engine surviving whatever gets past it.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import threading

import pytest

import llmserve.engine.engine as engine_module
import llmserve.output as output_module
from llmserve import LLM, SamplingParams
from llmserve.detokenize import IncrementalDetokenizer
from llmserve.engine.core import EngineCore
from llmserve.engine.messages import EngineReady
from llmserve.server.engine_client import EngineClient, EngineError, RequestError
from llmserve.worker.model_worker import ModelWorker
from llmserve.worker.protocol import StepInput, StepOutput, WorkerInitArgs

DTYPE = os.environ.get("LLMSERVE_TEST_DTYPE")   # as in tests/test_llm.py
KV_TOKENS = 4096
N = 10   # new tokens per request

GOOD_PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3,", "def main():"]
GOOD_PARAMS = [
    SamplingParams(max_new_tokens=N, temperature=0, ignore_eos=True),
    SamplingParams(max_new_tokens=N, temperature=1.0, top_k=40, seed=7, ignore_eos=True),
    SamplingParams(max_new_tokens=N, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True),
    SamplingParams(max_new_tokens=N, temperature=0, repetition_penalty=1.3, ignore_eos=True),
]


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def tiny(tiny_llama_dir, request):
    """The tiny model, with the plain and with the overlapped step loop (where a step's failure
    is read with the output of the step before it)."""
    with LLM(tiny_llama_dir, dtype=DTYPE, max_total_token_num=KV_TOKENS, overlap=request.param) as llm:
        yield llm


def poisoned(**fields) -> SamplingParams:
    """Sampling parameters that break the worker's sampler (once let past verify())."""
    params = SamplingParams(max_new_tokens=N, temperature=1.0, seed=1, ignore_eos=True)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


_EXPECTED: list[list[int]] = []


def expected_alone(llm: LLM) -> list[list[int]]:
    """``alone``'s answer, computed once: every ``tiny`` has the same weights, and its two loops
    give the same tokens (tests/engine/test_overlap.py)."""
    if not _EXPECTED:
        _EXPECTED.extend(alone(llm))
    return _EXPECTED


def alone(llm: LLM) -> list[list[int]]:
    return [llm.generate([p], params)[0].token_ids for p, params in zip(GOOD_PROMPTS, GOOD_PARAMS)]


def assert_idle(llm: LLM) -> None:
    """Nothing of the failed batch is left in the engine: no request, no KV slot."""
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.num_used_slots == 0
    assert not llm.engine.requests


POISONS = {
    # the draw's setup: a top-k no int64 tensor can hold (the request)
    "top_k_overflows": (poisoned(top_k=2**63), "Overflow"),
    # after every row has drawn: the good rows' generators moved, and must not move twice
    "logprobs_after_the_draw": (poisoned(logprobs=-1), "out of range"),
    # the sampler's setup of the request (add_request)
    "sampler_setup": (poisoned(stop_token_ids=[[0]]), "unhashable"),
}


@pytest.mark.parametrize("poison", list(POISONS))
def test_poisonous_sampling_params_fail_alone(tiny, poison, monkeypatch):
    params, words = POISONS[poison]
    expected = expected_alone(tiny)
    # the poison in the middle of the batch, so rows on both sides of it must survive
    prompts = GOOD_PROMPTS[:2] + ["Poison:"] + GOOD_PROMPTS[2:]
    with monkeypatch.context() as unchecked:
        unchecked.setattr(SamplingParams, "verify", lambda self: None)
        unchecked.setattr(engine_module, "check_request", lambda *args: None)
        outs = tiny.generate(prompts, GOOD_PARAMS[:2] + [params] + GOOD_PARAMS[2:])
    bad = outs.pop(2)
    assert bad.finish_reason == "error" and words in bad.error, bad
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    assert_idle(tiny)
    assert alone(tiny) == expected     # and it goes on serving, as before


def test_a_detokenizer_error_mid_generation_fails_that_request_alone(tiny, monkeypatch):
    poison_prompt = tiny.tokenizer("Poison:").input_ids
    fail_at = 4

    class FailingDetokenizer(IncrementalDetokenizer):
        """Raises on the poisoned request's ``fail_at``-th token, as a tokenizer might on odd ids."""

        def __init__(self, tokenizer, prompt_token_ids):
            super().__init__(tokenizer, prompt_token_ids=prompt_token_ids)
            self.poisoned, self.tokens = list(prompt_token_ids) == poison_prompt, 0

        def step(self, token_id: int) -> str:
            self.tokens += 1
            if self.poisoned and self.tokens == fail_at:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return super().step(token_id)

    expected = expected_alone(tiny)
    monkeypatch.setattr(output_module, "IncrementalDetokenizer", FailingDetokenizer)
    outs = tiny.generate(["Poison:", *GOOD_PROMPTS], [GOOD_PARAMS[0], *GOOD_PARAMS])
    bad = outs.pop(0)
    assert bad.finish_reason == "error" and "UnicodeDecodeError" in bad.error, bad
    assert len(bad.token_ids) == fail_at - 1       # what it had before
    assert [o.token_ids for o in outs] == expected
    assert_idle(tiny)


# -- a forward that raises ----------------------------------------------------------------

class InProcessWorkers:
    """The engine's worker group as one ModelWorker in this process (so that its forward can be
    made to fail), messages pickled both ways as over rpyc."""

    def __init__(self, worker: ModelWorker):
        self.worker = worker
        self.info = worker.info()

    def step(self, step: StepInput) -> StepOutput | None:
        return pickle.loads(pickle.dumps(self.worker.step(pickle.loads(pickle.dumps(step)))))

    def failure(self) -> str | None:
        return None


@pytest.fixture
def failing_forward(tiny):
    """``tiny`` running on an in-process worker whose forward raises on any batch that feeds a
    token of ``poison`` (a set the test fills); yields (llm, poison, worker)."""
    engine = tiny.engine
    worker = ModelWorker(WorkerInitArgs(
        model_path=engine.model_path, model_type=engine.info.model_type, rank=0, world_size=1,
        device=engine.info.device,  # as tiny's own worker: CPU and CUDA generators draw different noise
        dtype=DTYPE, max_total_token_num=KV_TOKENS, max_running_requests=engine.config.max_running_requests,
        eos_token_ids=sorted(engine.eos_token_ids),
    ))
    poison: set[int] = set()
    # It fails in the last layer: once the step's KV slots are taken and the first layer's written.
    model, fed = worker.model, set()
    forward, last_layer = model.forward, model.layers_infer[-1]
    last_layer_forward = last_layer.forward

    def recording_forward(input_ids, *args, **kwargs):
        fed.clear()
        fed.update(input_ids.tolist())
        return forward(input_ids, *args, **kwargs)

    def failing_last_layer(*args, **kwargs):
        if poison & fed:
            raise RuntimeError("a kernel failed on these rows")
        return last_layer_forward(*args, **kwargs)

    model.forward, last_layer.forward = recording_forward, failing_last_layer
    tiny.reset_prefix_cache()   # the prefix cache's slots are the real worker's: a new worker starts empty
    real_workers, engine.workers = engine.workers, InProcessWorkers(worker)
    try:
        yield tiny, poison, worker
    finally:
        tiny.reset_prefix_cache()
        engine.workers = real_workers


def assert_kv_all_free(llm: LLM, worker: ModelWorker) -> None:
    """Every slot is free once the prefix cache lets go of what it keeps."""
    llm.reset_prefix_cache()
    assert not worker.prefix_slots.node_slots
    model = worker.model
    assert model.mem_manager.can_use_mem_size == model.mem_manager.size
    assert model.req_manager.can_use_req_size == model.req_manager.max_request_num
    assert not worker.req_rows


def test_a_forward_failing_on_prompts_fails_those_requests_alone(failing_forward):
    llm, poison, worker = failing_forward
    expected = expected_alone(llm)
    bad_prompts = ["Poison: zebra", "More poison: zebra"]
    poison.update(llm.tokenizer(" zebra", add_special_tokens=False).input_ids)
    assert not any(poison & set(llm.tokenizer(p).input_ids) for p in GOOD_PROMPTS)
    # the two poisoned prompts apart, so the batch is split more than once to find them
    prompts = [bad_prompts[0], *GOOD_PROMPTS[:3], bad_prompts[1], GOOD_PROMPTS[3]]
    params = [GOOD_PARAMS[0], *GOOD_PARAMS[:3], GOOD_PARAMS[1], GOOD_PARAMS[3]]
    outs = llm.generate(prompts, params)
    bad = [outs.pop(4), outs.pop(0)]
    for b in bad:
        assert b.finish_reason == "error" and "a kernel failed" in b.error and not b.token_ids, b
    assert [o.token_ids for o in outs] == expected
    llm.engine.flush()
    assert_idle(llm)
    assert_kv_all_free(llm, worker)
    assert alone(llm) == expected


@pytest.mark.parametrize("max_new_tokens,poisoned", [(N, 2), (3, 1)], ids=["mid_generation", "last_step"])
def test_a_forward_failing_on_a_decode_step_fails_that_request_alone(failing_forward, max_new_tokens, poisoned):
    """The request's token ``poisoned`` (0-based) becomes poison: the forward of the decode step
    that feeds it fails, with every other request in it (none of which sees that token). In
    "last_step" that step draws the request's last token, so the overlapped loop has retired the
    request from the scheduler by the time the failure is read."""
    llm, poison, worker = failing_forward
    expected = expected_alone(llm)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    (victim,) = llm.generate(["Poison:"], params)
    token = victim.token_ids[poisoned]
    assert all(token not in ids + llm.tokenizer(p).input_ids for ids, p in zip(expected, GOOD_PROMPTS))
    poison.add(token)
    outs = llm.generate(["Poison:", *GOOD_PROMPTS], [params, *GOOD_PARAMS])
    bad = outs.pop(0)
    assert bad.finish_reason == "error" and "a kernel failed" in bad.error, bad
    assert bad.token_ids == victim.token_ids[: poisoned + 1]
    assert [o.token_ids for o in outs] == expected
    llm.engine.flush()
    assert_idle(llm)
    assert_kv_all_free(llm, worker)


# -- the server's engine core and its client ----------------------------------------------

async def tokens(stream) -> list[int]:
    return [event.token_id async for event in stream]


def run_router(llm: LLM, monkeypatch, main) -> tuple:
    """``await main(router)`` on the server's EngineClient, talking over a socket pair to an
    EngineCore that runs ``llm``'s engine on a thread of this process (so that the tests can
    patch the engine; the server runs the same loop in a process of its own). The engine stays
    open for the other tests. Returns main's result and whether the client stayed healthy."""
    monkeypatch.setattr(llm.engine, "shutdown", lambda: None)
    ours, theirs = socket.socketpair()
    engine = llm.engine
    core = threading.Thread(target=EngineCore(engine, theirs).run, name="test-engine-core")
    core.start()

    async def run():
        ready = EngineReady(engine.info, engine.config, engine.model, engine.summary())
        router = EngineClient(ours, ready, llm.tokenizer)
        await router.start()
        try:
            return await main(router), router.is_healthy and router.error is None
        finally:
            await router.close()

    try:
        return asyncio.run(run())
    finally:
        core.join(timeout=30)
        assert not core.is_alive(), "the engine core did not stop when the client closed"
        theirs.close()


def test_the_router_ends_only_the_failed_stream(tiny, monkeypatch):
    """The failed request's stream raises RequestError (an EngineError, which the APIs answer as
    such), the others stream to their end, and the router stays healthy and serving."""
    monkeypatch.setattr(SamplingParams, "verify", lambda self: None)
    prompts = [tiny.tokenizer(p).input_ids for p in ["Poison:", *GOOD_PROMPTS]]

    async def main(router: EngineClient) -> tuple[list, list[int]]:
        streams = [router.generate(ids, params) for ids, params in zip(prompts, [poisoned(top_k=2**63), *GOOD_PARAMS])]
        results = await asyncio.gather(*(tokens(s) for s in streams), return_exceptions=True)
        return results, await tokens(router.generate(prompts[1], GOOD_PARAMS[0]))

    (results, after), healthy = run_router(tiny, monkeypatch, main)
    assert healthy
    bad = results.pop(0)
    assert isinstance(bad, RequestError) and "Overflow" in str(bad), bad
    expected = expected_alone(tiny)
    assert results == expected
    assert after == expected[0]
    assert_idle(tiny)


def test_a_step_failing_for_no_request_costs_the_requests_in_flight_not_the_router(tiny, monkeypatch):
    """An engine step that raises without a worker's failure (a bug of ours, tied to no request):
    the requests in flight end with an EngineError, and the router goes on serving."""
    schedule, failures = tiny.engine.scheduler.schedule, []

    def schedule_failing_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("a scheduler bug")
        return schedule()

    prompts = [tiny.tokenizer(p).input_ids for p in GOOD_PROMPTS]

    async def main(router: EngineClient) -> tuple[list, list[int]]:
        monkeypatch.setattr(tiny.engine.scheduler, "schedule", schedule_failing_once)
        streams = [router.generate(ids, params) for ids, params in zip(prompts, GOOD_PARAMS)]
        results = await asyncio.gather(*(tokens(s) for s in streams), return_exceptions=True)
        return results, await tokens(router.generate(prompts[0], GOOD_PARAMS[0]))

    (results, after), healthy = run_router(tiny, monkeypatch, main)
    assert healthy
    assert all(isinstance(r, EngineError) and "a scheduler bug" in str(r) for r in results), results
    assert after == alone(tiny)[0]
    assert_idle(tiny)
