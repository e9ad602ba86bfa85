"""The one admission check (engine/admission.py): what it refuses, in whose field names, and
that the engine behind it accepts everything it admits."""

import random

import pytest

from llmserve.engine.admission import RequestLimits, check_request
from llmserve.engine.request import Request
from llmserve.engine.scheduler import Scheduler, SchedulerConfig
from llmserve.sampling_params import InvalidRequest, SamplingParams
from llmserve.worker.protocol import WorkerInfo

INFO = WorkerInfo(model_type="llama", vocab_size=100, max_total_token_num=100, max_seq_len=1000, max_running_requests=8,
                  dtype="float32", device="cpu", num_layers=1, num_params=1)


def refusal(prompt: list[int], params: SamplingParams, limits: RequestLimits) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        check_request(prompt, params, limits)
    return e.value


def test_limits_of_the_model_and_of_the_operator():
    assert RequestLimits.of_model(INFO) == RequestLimits(100, 99, 100)        # the KV pool is the tighter bound
    assert RequestLimits.of_model(INFO, max_model_len=50) == RequestLimits(100, 49, 50)
    assert RequestLimits.of_model(INFO, max_model_len=500, max_input_tokens=20) == RequestLimits(100, 20, 100)
    with pytest.raises(ValueError, match="max_input_tokens"):
        RequestLimits.of_model(INFO, max_model_len=1)
    assert RequestLimits(100, 49, 50).room_for(45) == 5 and RequestLimits(100, 49, 50).room_for(60) == 1


def test_what_is_refused_and_the_field_to_blame():
    limits = RequestLimits.of_model(INFO)
    check_request([1] * 90, SamplingParams(max_new_tokens=10), limits)          # exactly fits
    cases = [
        ([], SamplingParams(), "prompt", "no tokens"),
        ([5, 100], SamplingParams(), "prompt", "[0, 100)"),
        ([5, -1], SamplingParams(), "prompt", "[0, 100)"),
        ([1], SamplingParams(stop_token_ids=[100]), "stop_token_ids", "[0, 100)"),
        ([1] * 100, SamplingParams(max_new_tokens=1), "prompt", "less than 100 tokens. Given: 100"),
        ([1] * 90, SamplingParams(max_new_tokens=11), "max_new_tokens", "must be <= 100"),
    ]
    for prompt, params, field, words in cases:
        e = refusal(prompt, params, limits)
        assert e.field == field and words in str(e), (field, str(e))


def test_each_api_renders_the_message_in_its_own_names():
    e = refusal([1] * 90, SamplingParams(max_new_tokens=11), RequestLimits.of_model(INFO))
    assert str(e) == "prompt tokens + max_new_tokens must be <= 100. Given: 90 prompt tokens and 11 max_new_tokens"
    assert e.render({"prompt": "inputs"}, quote=True) == (
        "`inputs` tokens + `max_new_tokens` must be <= 100. Given: 90 `inputs` tokens and 11 `max_new_tokens`")
    assert e.render({"prompt": "messages", "max_new_tokens": "max_completion_tokens"}) == (
        "messages tokens + max_completion_tokens must be <= 100. Given: 90 messages tokens and 11 max_completion_tokens")
    with pytest.raises(InvalidRequest) as bad:
        SamplingParams(max_new_tokens=4, min_tokens=5)
    assert bad.value.field == "min_tokens"
    assert bad.value.render({"max_new_tokens": "max_tokens"}) == "min_tokens must be an integer in [0, max_tokens=4], got 5"


def test_the_engine_takes_whatever_the_check_admits():
    """Random requests: each one check_request admits, the scheduler (which only asserts) takes
    and runs to its end within the pool; each one it refuses would have broken an assertion or
    the pool's accounting."""
    rng = random.Random(0)
    limits = RequestLimits.of_model(INFO)
    for i in range(2000):
        prompt = [rng.randrange(-2, 103) for _ in range(rng.choice([0, 1, 5, 50, 99, 100, 101]))]
        params = SamplingParams(max_new_tokens=rng.choice([1, 2, 10, 50, 101]))
        try:
            check_request(prompt, params, limits)
        except InvalidRequest:
            admitted = False
        else:
            admitted = True
        scheduler = Scheduler(SchedulerConfig(max_total_token_num=INFO.max_total_token_num))
        req = Request(i, prompt, params)
        fits = 0 < len(prompt) <= limits.max_input_tokens and len(prompt) + params.max_new_tokens <= limits.max_model_len \
            and all(0 <= t < INFO.vocab_size for t in prompt)
        assert admitted == fits, (len(prompt), params.max_new_tokens)
        if admitted:
            scheduler.add_request(req)   # asserts only: an admitted request never trips them
            out = scheduler.schedule()
            assert [s.request for s in out.scheduled] == [req]
