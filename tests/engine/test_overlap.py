"""The overlapped step loop (``EngineConfig.overlap``) gives exactly the output of the plain one.

With overlap the engine schedules step N+1 before it reads step N's tokens, and the worker feeds
a decoding request the token it drew last step without the engine having seen it. On the CPU it
gains nothing (every forward is synchronous there), but its bookkeeping is the same as on a GPU,
so these tests hold it against the plain loop token for token: requests that join and leave,
chunked prompts, preemptions, stops that fire while a step of the request is already in flight,
aborts (stop strings), seeded sampling, penalties, logprobs and prompt logprobs.
"""

from __future__ import annotations

import os
import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.scheduler import Scheduler

DTYPE = os.environ.get("LLMSERVE_TEST_DTYPE")
KV_TOKENS = 320        # small: the batch below outgrows it, so requests are preempted
PREFILL_TOKENS = 64    # small: longer prompts are chunked


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype=DTYPE, max_total_token_num=KV_TOKENS, max_prefill_tokens=PREFILL_TOKENS) as llm:
        yield llm


def run(llm: LLM, overlap: bool, prompts, params, monkeypatch) -> tuple[list, list, int]:
    """Outputs, the batches the scheduler made (per step: each request's index in ``prompts``
    and its number of new tokens), and how many preemptions it made."""
    batches, preempted = [], []
    schedule, preempt = Scheduler.schedule, Scheduler._preempt
    def recording_schedule(self):
        output = schedule(self)
        if output.scheduled:
            batches.append([(s.request.req_id, s.num_new_tokens) for s in output.scheduled])
        return output

    monkeypatch.setattr(Scheduler, "schedule", recording_schedule)
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, req: (preempted.append(req.req_id), preempt(self, req)))
    llm.engine.overlap = overlap
    llm.reset_prefix_cache()   # each run starts cold, or the second would prefill less and batch otherwise
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.overlap = False
        monkeypatch.undo()
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.num_used_slots == 0
    first_id = min(req_id for batch in batches for req_id, _ in batch)   # this call's requests count from it
    return outs, [[(req_id - first_id, n) for req_id, n in batch] for batch in batches], len(preempted)


def assert_same(overlapped, plain) -> None:
    """Equal outputs: tokens, text and finish reasons exactly; logprobs to float rounding, and the
    top alternatives' ids exactly except where two of them tie to that rounding. (Under overlap
    a request may share its steps with other requests than in the plain loop, which keeps a
    stopped request one step longer, and batches of other shapes round differently.)"""
    for o, p in zip(overlapped, plain, strict=True):
        assert (o.token_ids, o.text, o.finish_reason, o.error) == (p.token_ids, p.text, p.finish_reason, p.error)
        for a, b in [(o.logprobs, p.logprobs), (o.prompt_logprobs, p.prompt_logprobs)]:
            assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=TOL))
        for a, b in [(o.top_logprobs, p.top_logprobs), (o.prompt_top_logprobs, p.prompt_top_logprobs)]:
            assert (a is None) == (b is None)
            for row_a, row_b in zip(a or [], b or [], strict=True):
                assert_same_top(row_a, row_b)


def assert_same_top(a: list[tuple[int, float]] | None, b: list[tuple[int, float]] | None) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    values = [v for _, v in b]
    assert [v for _, v in a] == pytest.approx(values, abs=TOL)
    for i, ((id_a, _), (id_b, _)) in enumerate(zip(a, b, strict=True)):
        neighbours = values[max(0, i - 1) : i + 2]
        tied = len(neighbours) > 1 and min(abs(x - y) for x, y in zip(neighbours, neighbours[1:])) <= TOL
        assert id_a == id_b or tied, (a, b)


TOL = 1e-4


def workload(vocab: int, n: int = 16, seed: int = 0):
    rng = random.Random(seed)
    # mostly short prompts that generate long: admitted together, their decodes outgrow the pool
    prompts = [[rng.randrange(vocab) for _ in range(rng.choice([5, 12, 20, 150]))] for _ in range(n)]
    kinds = [
        dict(temperature=0),
        dict(temperature=1.0, top_k=20, seed=7),
        dict(temperature=0.8, top_p=0.9, seed=11, logprobs=3),
        dict(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=1.0, seed=3, prompt_logprobs=2, min_tokens=1),
    ]
    params = [SamplingParams(max_new_tokens=rng.choice([1, 2, 7, 40, 60]), ignore_eos=True, **kinds[i % len(kinds)])
              for i in range(n)]
    return prompts, params


def test_overlap_equals_the_plain_loop(llm, monkeypatch):
    # Requests that end by length only: the overlapped loop retires each as its final token is
    # drawn, so it makes the plain loop's batches, and every number comes out the same.
    prompts, params = workload(llm.engine.info.vocab_size)
    plain, plain_batches, plain_preemptions = run(llm, False, prompts, params, monkeypatch)
    overlapped, batches, preemptions = run(llm, True, prompts, params, monkeypatch)
    assert batches == plain_batches
    assert overlapped == plain
    assert preemptions == plain_preemptions > 0, "the workload should outgrow the KV pool"


def test_overlap_at_tp2_equals_the_plain_loop(tiny_llama_dir, monkeypatch):
    # At tp > 1 the other rank feeds a pending token from rank 0's broadcast of its draw.
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tp=2 needs 2 GPUs")
    with LLM(tiny_llama_dir, tp=2, dtype=DTYPE, max_total_token_num=KV_TOKENS, max_prefill_tokens=PREFILL_TOKENS) as tp2:
        prompts, params = workload(tp2.engine.info.vocab_size)
        plain, plain_batches, plain_preemptions = run(tp2, False, prompts, params, monkeypatch)
        overlapped, batches, preemptions = run(tp2, True, prompts, params, monkeypatch)
    assert batches == plain_batches
    assert_same(overlapped, plain)
    assert preemptions == plain_preemptions > 0, "the workload should outgrow the KV pool"


def test_stops_that_fire_with_the_next_step_in_flight(llm, monkeypatch):
    # Stop tokens, EOS and stop strings picked from the plain run's own outputs, so that they fire
    # mid-stream: with overlap the request's next step is then already running, and its token
    # must be dropped (a stop string aborts the request from the front end).
    prompts, params = workload(llm.engine.info.vocab_size, seed=1)
    params = [SamplingParams(**{**vars(p), "max_new_tokens": 30, "stop": []}) for p in params]
    free_run, _, _ = run(llm, False, prompts, params, monkeypatch)
    for i, (p, out) in enumerate(zip(params, free_run)):
        if i % 3 == 0:
            p.stop_token_ids = [out.token_ids[5]]
        elif i % 3 == 1:
            p.stop = [llm.tokenizer.decode(out.token_ids[8:10])]
        else:
            p.ignore_eos, p.stop_token_ids = False, [out.token_ids[12]]
    plain, _, _ = run(llm, False, prompts, params, monkeypatch)
    overlapped, _, _ = run(llm, True, prompts, params, monkeypatch)
    assert_same(overlapped, plain)
    reasons = {o.finish_reason for o in plain}
    assert "stop_sequence" in reasons and sum(len(o.token_ids) < 30 for o in plain) >= len(plain) // 2


def guided_workload(vocab: int, n: int = 16, seed: int = 2):
    """``workload``'s prompts (chunked, preempted) under grammars that every draw completes."""
    import json

    from llmserve.sampling_params import GuidedDecodingParams

    schema = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 3},
        "name": {"type": "string", "maxLength": 8}}, "required": ["id", "tags", "name"], "additionalProperties": False}
    guided = [GuidedDecodingParams(json=json.dumps(schema)), GuidedDecodingParams(regex="[a-z]{2,6}( [0-9]{1,3}){1,4}"),
              GuidedDecodingParams(choice=("yes", "no", "maybe")), None]
    prompts, _ = workload(vocab, n, seed)
    params = [SamplingParams(max_new_tokens=90, temperature=[1.0, 0.0][i % 2], seed=i, guided_decoding=guided[i % 4])
              for i in range(n)]
    return prompts, params


def test_overlap_equals_the_plain_loop_under_grammars(llm, monkeypatch):
    # Constrained requests end at EOS once their grammar is complete, often while their next
    # step is in flight: that step's draw (against a finished grammar) must be dropped.
    prompts, params = guided_workload(llm.engine.info.vocab_size)
    plain, _, plain_preemptions = run(llm, False, prompts, params, monkeypatch)
    overlapped, _, _ = run(llm, True, prompts, params, monkeypatch)
    assert_same(overlapped, plain)
    assert plain_preemptions > 0, "the workload should outgrow the KV pool"
    assert all(o.finish_reason == "eos_token" for o, p in zip(plain, params) if p.guided_decoding is not None)
