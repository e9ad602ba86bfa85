"""The token rules of the engine's Request (its text is the front end's: tests/test_output.py)."""

from __future__ import annotations

import time

import pytest

from llmserve.engine.request import FinishReason, Request, RequestDelta, RequestStatus
from llmserve.sampling_params import SamplingParams

EOS = 2


def make_request(**params) -> Request:
    return Request(req_id=0, prompt_token_ids=[5, 6, 7], params=SamplingParams(**params))


def test_token_counts_and_all_token_ids():
    req = make_request(max_new_tokens=10)
    req.append_token(11)
    req.append_token(12)
    assert req.all_token_ids == [5, 6, 7, 11, 12]
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (5, 3, 2)
    assert not req.is_finished and req.finish_reason is None


def test_length():
    req = make_request(max_new_tokens=3)
    for token_id in (11, 12):
        assert req.append_token(token_id) is None
    assert req.append_token(13) is FinishReason.LENGTH
    assert req.status is RequestStatus.FINISHED and req.is_finished
    assert req.num_output_tokens == 3


def test_eos():
    req = make_request(max_new_tokens=10)
    req.append_token(11)
    assert req.append_token(EOS, eos_token_ids={EOS}) is FinishReason.EOS_TOKEN
    assert req.output_token_ids == [11, EOS]


def test_ignore_eos():
    req = make_request(max_new_tokens=2, ignore_eos=True)
    req.append_token(EOS, eos_token_ids={EOS})
    assert not req.is_finished
    assert req.append_token(EOS, eos_token_ids={EOS}) is FinishReason.LENGTH


def test_stop_token_id_wins():
    # The stop token is also an EOS and the last allowed token: stop_token_ids is checked first.
    req = make_request(max_new_tokens=2, stop_token_ids=[EOS])
    req.append_token(11)
    assert req.append_token(EOS, eos_token_ids={EOS}) is FinishReason.STOP_SEQUENCE


def test_stop_strings_are_not_the_engines():
    req = make_request(max_new_tokens=3, stop=["a"])
    assert [req.append_token(t) for t in (11, 12, 13)] == [None, None, FinishReason.LENGTH]


def test_logprobs_recorded_only_when_asked():
    req = make_request(max_new_tokens=5)
    req.append_token(11, logprob=-0.5, top_logprobs=[(11, -0.5)])
    assert req.output_logprobs == [] and req.output_top_logprobs == []

    req = make_request(max_new_tokens=5, logprobs=1)
    req.append_token(11, logprob=-0.5, top_logprobs=[(11, -0.5)])
    req.append_token(12, logprob=-1.5, top_logprobs=[(13, -0.1)])
    assert req.output_logprobs == [-0.5, -1.5]
    assert req.output_top_logprobs == [[(11, -0.5)], [(13, -0.1)]]


def test_token_slice_equals_slicing_all_token_ids():
    req = Request(req_id=0, prompt_token_ids=[10, 11, 12, 13], params=SamplingParams(max_new_tokens=8))
    req.output_token_ids = [20, 21, 22]
    everything = req.all_token_ids
    for start in range(len(everything) + 1):
        for stop in range(start, len(everything) + 1):
            assert req.token_slice(start, stop) == everything[start:stop], (start, stop)


def test_min_tokens_lets_no_stop_rule_but_length_end_the_first_tokens():
    req = make_request(max_new_tokens=10, min_tokens=2, stop_token_ids=[50])
    assert req.append_token(EOS, eos_token_ids={EOS}) is None
    assert req.append_token(50) is None
    assert req.append_token(50) is FinishReason.STOP_SEQUENCE     # past min_tokens: stop rules again


@pytest.mark.parametrize(("token_id", "reason"), [(EOS, FinishReason.EOS_TOKEN), (50, FinishReason.STOP_SEQUENCE)])
def test_min_tokens_then_eos_or_stop_id(token_id: int, reason: FinishReason):
    req = make_request(max_new_tokens=10, min_tokens=1, stop_token_ids=[50])
    req.append_token(11, eos_token_ids={EOS})
    assert req.append_token(token_id, eos_token_ids={EOS}) is reason


def test_min_tokens_equal_to_max_new_tokens_stops_on_length():
    req = make_request(max_new_tokens=2, min_tokens=2)
    req.append_token(EOS, eos_token_ids={EOS})
    assert req.append_token(EOS, eos_token_ids={EOS}) is FinishReason.LENGTH


def test_prompt_logprobs_are_set_once_per_prompt_token():
    req = make_request(prompt_logprobs=1)
    assert req.needs_prompt_logprobs
    req.set_prompt_logprobs([None, -1.0, -2.0], [None, [(6, -1.0)], [(9, -0.5)]])
    assert not req.needs_prompt_logprobs
    assert req.prompt_logprobs == [None, -1.0, -2.0]
    assert not make_request().needs_prompt_logprobs
    with pytest.raises(AssertionError):
        make_request(prompt_logprobs=0).set_prompt_logprobs([None], [None])   # not one per prompt token


def test_delta_sends_prompt_logprobs_with_the_first_token_only():
    req = make_request(max_new_tokens=5, logprobs=0, prompt_logprobs=0)
    req.set_prompt_logprobs([None, -1.0, -2.0], [None, [], []])
    req.append_token(11, logprob=-0.25, top_logprobs=[])
    first = RequestDelta.of(req)
    assert (first.token_id, first.logprob, first.prompt_logprobs) == (11, -0.25, [None, -1.0, -2.0])
    req.append_token(12, logprob=-0.5, top_logprobs=[])
    second = RequestDelta.of(req)
    assert (second.token_id, second.logprob, second.prompt_logprobs, second.finish_reason) == (12, -0.5, None, None)


def test_delta_of_a_failed_request_has_no_token():
    req = make_request()
    req.error = "boom"
    req.finish(FinishReason.ERROR)
    delta = RequestDelta.of(req)
    assert (delta.token_id, delta.finish_reason, delta.error) == (None, FinishReason.ERROR, "boom")


def test_the_first_tokens_delta_carries_queue_and_prefill_times():
    """For /metrics: the engine core's view of when the request waited and when it prefilled."""
    req = make_request(max_new_tokens=3)
    req.arrival_time = time.monotonic() - 2.0
    req.first_scheduled_time = req.arrival_time + 1.5
    req.append_token(5)
    first = RequestDelta.of(req)
    assert first.queue_time == pytest.approx(1.5)
    assert 0.5 <= first.prefill_time < 1.0
    req.append_token(6)
    later = RequestDelta.of(req)
    assert later.queue_time is None and later.prefill_time is None
