"""Driving a bare ``Scheduler`` as the engine would, without workers: tests/engine's
test_scheduler.py, test_drafting.py and test_prefix_cache.py."""

from __future__ import annotations

from llmserve.engine.request import Request
from llmserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from llmserve.sampling_params import SamplingParams

EOS = 2
TOKEN = 7  # any token that does not stop a request


def make_request(req_id: int, prompt_len: int, max_new_tokens: int = 16) -> Request:
    # Arrival order = id order, independent of the clock's resolution.
    return Request(
        req_id=req_id,
        prompt_token_ids=[TOKEN] * prompt_len,
        params=SamplingParams(max_new_tokens=max_new_tokens),
        arrival_time=float(req_id),
    )


def make_scheduler(pool: int, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(max_total_token_num=pool, **config))


def run_step(scheduler: Scheduler, eos_for: set[int] = frozenset()) -> SchedulerOutput:
    """What the engine does with one step: run it, then append one sampled token to every
    scheduled request (requests in ``eos_for`` sample EOS) and finish those that stop."""
    output = scheduler.schedule()
    scheduler.update_after_step(output)
    for item in output.scheduled:
        req = item.request
        if not item.samples:   # a chunk of a prompt that goes on next step
            continue
        token = EOS if req.req_id in eos_for else TOKEN
        reason = req.append_token(token, eos_token_ids={EOS})
        if reason is not None:
            scheduler.finish_request(req, reason)
    return output


def scheduled_ids(output: SchedulerOutput) -> list[int]:
    return [item.request.req_id for item in output.scheduled]

