"""Continuous batching: admission, FIFO order, limits, preemption, and random workloads."""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmserve.sampling_params import SamplingParams
from llmserve.engine.request import FinishReason, Request, RequestStatus
from llmserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput

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


# --------------------------------------------------------------------------------------
# Admission
# --------------------------------------------------------------------------------------


def test_nothing_to_do():
    scheduler = make_scheduler(100)
    output = scheduler.schedule()
    assert output.scheduled == [] and output.preempted == []
    assert not scheduler.has_unfinished()


def test_admission_under_kv_budget():
    scheduler = make_scheduler(100)
    for i in range(4):
        scheduler.add_request(make_request(i, prompt_len=30))
    output = scheduler.schedule()
    # 3 prompts of 30 leave 10 slots, enough for the 3 next decodes; a 4th does not fit.
    assert scheduled_ids(output) == [0, 1, 2]
    assert [item.num_new_tokens for item in output.scheduled] == [30, 30, 30]
    assert scheduler.num_running == 3 and scheduler.num_waiting == 1
    assert all(item.request.status is RequestStatus.RUNNING for item in output.scheduled)


def test_admission_keeps_a_decode_slot_per_running_request():
    scheduler = make_scheduler(10)
    scheduler.add_request(make_request(0, prompt_len=5, max_new_tokens=5))
    scheduler.add_request(make_request(1, prompt_len=4, max_new_tokens=5))  # 5 + 4 leaves 1 slot for 2 decodes
    assert scheduled_ids(scheduler.schedule()) == [0]


def test_fifo_no_overtaking():
    scheduler = make_scheduler(100)
    scheduler.add_request(make_request(0, prompt_len=60))
    scheduler.add_request(make_request(1, prompt_len=50))  # does not fit next to 0
    scheduler.add_request(make_request(2, prompt_len=5))  # would fit, but must not overtake 1
    assert scheduled_ids(run_step(scheduler)) == [0]
    assert [r.req_id for r in scheduler.waiting] == [1, 2]


def test_max_running_requests():
    scheduler = make_scheduler(1000, max_running_requests=2)
    for i in range(5):
        scheduler.add_request(make_request(i, prompt_len=3))
    assert scheduled_ids(run_step(scheduler)) == [0, 1]
    assert scheduled_ids(run_step(scheduler)) == [0, 1]  # still full
    scheduler.finish_request(scheduler.running[0], FinishReason.ABORT)
    assert scheduled_ids(run_step(scheduler)) == [1, 2]


def chunks(output: SchedulerOutput) -> list[tuple[int, int, bool]]:
    return [(item.request.req_id, item.num_new_tokens, item.samples) for item in output.scheduled]


def test_max_prefill_tokens_whole_prompts():
    scheduler = make_scheduler(1000, max_prefill_tokens=100, chunked_prefill=False)
    for i, prompt_len in enumerate([60, 30, 20]):
        scheduler.add_request(make_request(i, prompt_len))
    assert scheduled_ids(run_step(scheduler)) == [0, 1]  # 60 + 30 <= 100 < 60 + 30 + 20
    output = run_step(scheduler)
    assert [(item.request.req_id, item.num_new_tokens) for item in output.scheduled] == [(0, 1), (1, 1), (2, 20)]


def test_a_whole_prompt_longer_than_max_prefill_tokens_still_runs_alone():
    scheduler = make_scheduler(1000, max_prefill_tokens=100, chunked_prefill=False)
    scheduler.add_request(make_request(0, prompt_len=150))
    scheduler.add_request(make_request(1, prompt_len=10))
    assert scheduled_ids(run_step(scheduler)) == [0]
    assert scheduled_ids(run_step(scheduler)) == [0, 1]


def test_chunked_prefill_fills_the_budget_and_samples_with_the_last_chunk():
    scheduler = make_scheduler(1000, max_prefill_tokens=100)
    for i, prompt_len in enumerate([60, 30, 20]):
        scheduler.add_request(make_request(i, prompt_len))
    assert chunks(run_step(scheduler)) == [(0, 60, True), (1, 30, True), (2, 10, False)]
    # the prompt under way goes on before anything new; the others decode meanwhile
    assert chunks(run_step(scheduler)) == [(0, 1, True), (1, 1, True), (2, 10, True)]
    assert [r.num_output_tokens for r in scheduler.running] == [2, 2, 1]


def test_a_long_prompt_is_split_and_decodes_keep_running():
    scheduler = make_scheduler(1000, max_prefill_tokens=100)
    scheduler.add_request(make_request(0, prompt_len=10))
    run_step(scheduler)
    scheduler.add_request(make_request(1, prompt_len=250))
    scheduler.add_request(make_request(2, prompt_len=10))
    assert chunks(run_step(scheduler)) == [(0, 1, True), (1, 100, False)]
    assert chunks(run_step(scheduler)) == [(0, 1, True), (1, 100, False)]
    assert chunks(run_step(scheduler)) == [(0, 1, True), (1, 50, True), (2, 10, True)]
    assert scheduler.running[1].num_output_tokens == 1 and scheduler.running[1].num_cached == 250


def test_admission_reserves_the_whole_prompt():
    # 40 slots: request 1's 30-token prompt is admitted with a 10-token chunk, but the room for
    # all 30 is reserved, so request 2 (10 tokens) must wait although 20 slots look free.
    scheduler = make_scheduler(40, max_prefill_tokens=10)
    scheduler.add_request(make_request(0, prompt_len=5, max_new_tokens=4))
    scheduler.add_request(make_request(1, prompt_len=30, max_new_tokens=4))
    scheduler.add_request(make_request(2, prompt_len=10, max_new_tokens=4))
    assert chunks(run_step(scheduler)) == [(0, 5, True), (1, 5, False)]
    assert scheduler.num_waiting == 1
    assert chunks(run_step(scheduler)) == [(0, 1, True), (1, 10, False)]
    assert scheduler.num_waiting == 1


def test_decodes_and_prefills_share_a_step():
    scheduler = make_scheduler(100)
    scheduler.add_request(make_request(0, prompt_len=10))
    run_step(scheduler)
    scheduler.add_request(make_request(1, prompt_len=20))
    output = run_step(scheduler)
    assert [(item.request.req_id, item.num_new_tokens) for item in output.scheduled] == [(0, 1), (1, 20)]
    assert scheduler.num_used_slots == 11 + 20
    assert scheduler.num_free_slots == 100 - 31


def test_request_too_long_for_the_pool_is_a_bug_of_the_caller():
    # check_request refuses these at the edge (tests/engine/test_admission.py); the scheduler
    # only asserts that nothing past the edge breaks its accounting
    scheduler = make_scheduler(100)
    scheduler.add_request(make_request(0, prompt_len=90, max_new_tokens=10))  # exactly fits
    with pytest.raises(AssertionError):
        scheduler.add_request(make_request(1, prompt_len=90, max_new_tokens=11))
    with pytest.raises(AssertionError):
        scheduler.add_request(make_request(2, prompt_len=0))
    assert scheduler.num_waiting == 1


# --------------------------------------------------------------------------------------
# Finishing and aborting
# --------------------------------------------------------------------------------------


def test_finish_frees_slots_at_once():
    scheduler = make_scheduler(100)
    scheduler.add_request(make_request(0, prompt_len=10, max_new_tokens=2))
    run_step(scheduler)
    assert scheduler.num_used_slots == 10
    run_step(scheduler)  # second token: max_new_tokens reached
    assert scheduler.num_running == 0 and scheduler.num_used_slots == 0
    assert not scheduler.has_unfinished()


def test_eos_finishes():
    scheduler = make_scheduler(100)
    req = make_request(0, prompt_len=3)
    scheduler.add_request(req)
    run_step(scheduler, eos_for={0})
    assert req.finish_reason is FinishReason.EOS_TOKEN and req.is_finished
    assert scheduler.num_running == 0


def test_abort():
    scheduler = make_scheduler(100)
    running, waiting = make_request(0, prompt_len=60), make_request(1, prompt_len=60)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler)
    assert scheduler.abort_request(1) is waiting
    assert scheduler.abort_request(0) is running
    assert scheduler.abort_request(0) is None  # already gone
    assert scheduler.abort_request(42) is None
    assert running.finish_reason is waiting.finish_reason is FinishReason.ABORT
    assert running.status is RequestStatus.FINISHED
    assert not scheduler.has_unfinished() and scheduler.num_used_slots == 0


# --------------------------------------------------------------------------------------
# Preemption
# --------------------------------------------------------------------------------------


def test_preempts_newest_and_resumes_it_first():
    scheduler = make_scheduler(20)
    old, new = make_request(0, prompt_len=5, max_new_tokens=10), make_request(1, prompt_len=5, max_new_tokens=10)
    later = make_request(2, prompt_len=9, max_new_tokens=2)  # does not fit while both run
    for req in (old, new, later):
        scheduler.add_request(req)

    output = run_step(scheduler)
    while not output.preempted:
        assert scheduled_ids(output) == [0, 1]
        output = run_step(scheduler)

    # Both grew until their next decodes no longer fit: the newer one made room.
    assert output.preempted == [new]
    assert scheduled_ids(output) == [0]
    assert new.status is RequestStatus.WAITING and new.num_cached == 0
    assert list(scheduler.waiting) == [new, later]  # ahead of the later arrival
    generated = new.num_output_tokens
    assert generated > 0

    while new.status is RequestStatus.WAITING:
        output = run_step(scheduler)
        assert later.status is RequestStatus.WAITING  # no overtaking
    # Resumed with a prefill of everything it had: prompt and generated tokens.
    [item] = [item for item in output.scheduled if item.request is new]
    assert item.num_new_tokens == 5 + generated
    assert new.num_output_tokens == generated + 1

    while scheduler.has_unfinished():
        run_step(scheduler)
    assert [r.finish_reason for r in (old, new, later)] == [FinishReason.LENGTH] * 3
    assert [r.num_output_tokens for r in (old, new, later)] == [10, 10, 2]


def test_preempts_several_and_keeps_their_arrival_order():
    scheduler = make_scheduler(10)
    for i in range(5):
        scheduler.add_request(make_request(i, prompt_len=1, max_new_tokens=9))
    assert scheduled_ids(run_step(scheduler)) == [0, 1, 2, 3, 4]
    assert run_step(scheduler).preempted == []
    # 5 requests of 2 cached tokens fill the pool. Dropping the newest frees 2 slots for
    # 4 decodes: not enough, so the next newest goes too.
    output = run_step(scheduler)
    assert [r.req_id for r in output.preempted] == [4, 3]
    assert scheduled_ids(output) == [0, 1, 2]
    assert [r.req_id for r in scheduler.waiting] == [3, 4]
    assert scheduler.num_preemptions == 2       # for /metrics


def test_a_step_counts_its_decode_and_prompt_tokens():
    """For /metrics (tokens per step) and the periodic log line (prompt throughput)."""
    scheduler = make_scheduler(100, max_prefill_tokens=8)
    scheduler.add_request(make_request(0, prompt_len=3))
    first = run_step(scheduler)
    assert (first.num_decode_tokens, first.num_prefill_tokens, first.num_tokens) == (0, 3, 3)
    scheduler.add_request(make_request(1, prompt_len=20))     # split: 8 of it this step
    second = run_step(scheduler)
    assert (second.num_decode_tokens, second.num_prefill_tokens) == (1, 8)
    assert second.num_tokens == sum(s.num_new_tokens for s in second.scheduled)


def test_first_scheduling_is_recorded_once():
    scheduler = make_scheduler(100)
    req = make_request(0, prompt_len=2)
    scheduler.add_request(req)
    assert req.first_scheduled_time is None
    run_step(scheduler)
    first = req.first_scheduled_time
    assert first is not None
    scheduler._preempt(req)
    run_step(scheduler)
    assert req.first_scheduled_time == first


# --------------------------------------------------------------------------------------
# Random workloads
# --------------------------------------------------------------------------------------

@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]]]:
    """A KV pool size and requests (prompt length, max_new_tokens, arrival step) that each
    fit the pool alone, and that together often do not."""
    pool = draw(st.integers(8, 120))
    specs = []
    for _ in range(draw(st.integers(1, 25))):
        prompt_len = draw(st.integers(1, pool // 2))
        max_new_tokens = draw(st.integers(1, pool - prompt_len))
        arrival_step = draw(st.integers(0, 30))
        specs.append((prompt_len, max_new_tokens, arrival_step))
    return pool, specs


@settings(max_examples=300, deadline=None)
@given(
    workload=workloads(),
    max_running=st.integers(1, 8),
    max_prefill=st.integers(1, 80),
    chunked=st.booleans(),
    eos_probability=st.sampled_from([0.0, 0.02, 0.1]),
    abort_probability=st.sampled_from([0.0, 0.02]),
    rng=st.randoms(use_true_random=False),
)
def test_random_workload(
    workload: tuple[int, list[tuple[int, int, int]]],
    max_running: int,
    max_prefill: int,
    chunked: bool,
    eos_probability: float,
    abort_probability: float,
    rng: random.Random,
):
    pool, specs = workload
    scheduler = make_scheduler(pool, max_running_requests=max_running, max_prefill_tokens=max_prefill,
                               chunked_prefill=chunked)
    arrivals = [(arrival, make_request(i, prompt_len, max_new)) for i, (prompt_len, max_new, arrival) in enumerate(specs)]
    arrivals.sort(key=lambda pair: pair[0])  # stable: same-step arrivals keep id order
    accepted: list[Request] = []
    finished: list[Request] = []
    kv: dict[int, int] = {}  # what the workers hold: req_id -> cached tokens
    needs_reprefill: set[int] = set()  # preempted, not yet prefilled again
    admitted_last_step = False
    max_steps = 100 + 3 * sum(prompt_len + max_new for prompt_len, max_new, _ in specs)

    for step in range(max_steps):
        while arrivals and arrivals[0][0] <= step:
            req = arrivals.pop(0)[1]
            scheduler.add_request(req)
            accepted.append(req)
        if not arrivals and not scheduler.has_unfinished():
            break

        waiting_before = list(scheduler.waiting)
        output = scheduler.schedule()

        # Something runs whenever something is unfinished: nothing can starve or stall.
        assert bool(output.scheduled) == scheduler.has_unfinished()
        # A step right after admissions never needs to preempt.
        assert not (admitted_last_step and output.preempted)

        if output.preempted:
            event("preempted")
        for req in output.preempted:
            assert req.status is RequestStatus.WAITING and req.num_cached == 0
            del kv[req.req_id]  # the workers free its cache first
            needs_reprefill.add(req.req_id)

        ids = scheduled_ids(output)
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert len(ids) <= max_running
        for item in output.scheduled:
            req = item.request
            assert req.status is RequestStatus.RUNNING
            assert kv.get(req.req_id, 0) == req.num_cached
            # A step feeds the next uncached tokens, all of them unless a prompt is split; it
            # samples exactly when it reaches the end. A (re)prefill feeds prompt + generated tokens.
            assert item.num_new_tokens >= 1
            assert req.num_cached + item.num_new_tokens <= req.num_tokens
            assert item.samples == (req.num_cached + item.num_new_tokens == req.num_tokens)
            assert chunked or item.samples
            kv[req.req_id] = req.num_cached + item.num_new_tokens
            needs_reprefill.discard(req.req_id)
        assert sum(kv.values()) <= pool, "KV pool overcommitted"
        if chunked:   # decodes feed one token each; everything else is prefill, within the budget
            assert sum(item.num_new_tokens for item in output.scheduled
                       if not (item.num_new_tokens == 1 and item.request.num_cached > 0)) <= max_prefill

        # Admission is FIFO: the new prefills are the head of the queue, preempted first.
        admitted = [item.request for item in output.scheduled if item.request.num_cached == 0]
        queue_order = list(reversed(output.preempted)) + waiting_before
        assert admitted == queue_order[: len(admitted)]
        admitted_last_step = bool(admitted)

        scheduler.update_after_step(output)
        for item in output.scheduled:
            req = item.request
            if not item.samples:
                continue
            token = EOS if rng.random() < eos_probability else TOKEN
            reason = req.append_token(token, eos_token_ids={EOS})
            if reason is not None:
                scheduler.finish_request(req, reason)
                del kv[req.req_id]
                finished.append(req)
        if accepted and rng.random() < abort_probability:
            aborted = scheduler.abort_request(rng.choice(accepted).req_id)
            if aborted is not None:
                kv.pop(aborted.req_id, None)
                needs_reprefill.discard(aborted.req_id)
                finished.append(aborted)

        # Every accepted request is in exactly one place.
        places = [*scheduler.waiting, *scheduler.running, *finished]
        assert sorted(r.req_id for r in places) == sorted(r.req_id for r in accepted)
        assert scheduler.num_used_slots == sum(kv.values())
    else:
        pytest.fail(f"not done after {max_steps} steps")

    assert kv == {} and needs_reprefill == set()
    for req in accepted:
        assert req.is_finished
        if req.finish_reason is FinishReason.LENGTH:
            assert req.num_output_tokens == req.params.max_new_tokens


# --------------------------------------------------------------------------------------
# The overlapped loop: steps scheduled before the last one's tokens are read
# --------------------------------------------------------------------------------------


def test_a_pending_token_is_fed_and_a_retired_request_frees_its_slots():
    scheduler = make_scheduler(100)
    short, long = make_request(0, 4, max_new_tokens=2), make_request(1, 4, max_new_tokens=8)
    scheduler.add_request(short)
    scheduler.add_request(long)
    in_flight = []
    for _ in range(2):   # each step is sent before the one before it has reported (as the engine does)
        output = scheduler.schedule()
        scheduler.update_after_step(output)
        for item in output.scheduled:
            item.request.num_pending_tokens += item.samples
        in_flight.append(output)
        if len(in_flight) == 2:
            first = in_flight.pop(0)
            for item in first.scheduled:
                item.request.num_pending_tokens -= 1
                item.request.append_token(TOKEN)
    # Both prefilled, then both fed their first token while it was still pending.
    assert [item.num_new_tokens for item in in_flight[0].scheduled] == [1, 1]
    assert short.num_output_tokens == 1 and short.final_token_pending and not long.final_token_pending
    used = scheduler.num_used_slots
    scheduler.retire(short)
    assert scheduler.num_used_slots == used - short.num_cached
    assert scheduled_ids(scheduler.schedule()) == [1]
    short.num_pending_tokens = 0
    scheduler.finish_request(short, short.append_token(TOKEN))
    assert short.finish_reason is FinishReason.LENGTH and not scheduler.waiting


def test_a_request_preempted_with_its_token_in_flight_waits_for_it():
    scheduler = make_scheduler(100)
    req = make_request(0, 4)
    req.num_pending_tokens = 1           # as the engine leaves it after sending a step
    req.status = RequestStatus.WAITING
    scheduler.waiting.append(req)
    assert scheduler.schedule().scheduled == []
    req.num_pending_tokens = 0
    req.append_token(TOKEN)
    assert scheduled_ids(scheduler.schedule()) == [0]


# --------------------------------------------------------------------------------------
# Drafts (speculation)
# --------------------------------------------------------------------------------------


def decoding(scheduler: Scheduler, *reqs: Request) -> None:
    """Prefill the requests and give each its first token: the next step decodes them."""
    for req in reqs:
        scheduler.add_request(req)
    run_step(scheduler)


def drafts(output: SchedulerOutput) -> dict[int, int]:
    return {s.request.req_id: len(s.draft_token_ids) for s in output.scheduled if s.draft_token_ids}


def test_a_decode_drafts_from_its_prompt_up_to_k():
    scheduler = make_scheduler(200, speculate=4)
    req = make_request(0, prompt_len=20, max_new_tokens=50)
    decoding(scheduler, req)
    output = scheduler.schedule()
    [s] = output.scheduled
    assert s.draft_token_ids == [TOKEN] * 4 and s.num_new_tokens == 5 and output.num_draft_tokens == 4
    assert output.num_tokens == 5


def test_drafts_stop_short_of_max_new_tokens_the_kv_pool_and_the_token_budget():
    # max_new_tokens: 3 left, one of which the step's own token takes
    scheduler = make_scheduler(200, speculate=10)
    decoding(scheduler, make_request(0, 20, max_new_tokens=4))
    assert drafts(scheduler.schedule()) == {0: 2}
    # KV: 26 slots, 20 cached, the decode's 1, one kept for the next decode: 4 left for the draft
    scheduler = make_scheduler(26, speculate=10)
    decoding(scheduler, make_request(0, 20, max_new_tokens=6))
    assert drafts(scheduler.schedule()) == {0: 4}
    # the step's token budget (max_prefill_tokens) left by a prompt prefilled in the same step
    scheduler = make_scheduler(400, speculate=10, max_prefill_tokens=40)
    decoding(scheduler, make_request(0, 20, max_new_tokens=50))
    scheduler.add_request(make_request(1, 35))
    output = scheduler.schedule()
    assert drafts(output) == {0: 5} and output.num_prefill_tokens == 35


def test_no_drafts_for_large_batches_or_requests_that_opt_out():
    scheduler = make_scheduler(1000, speculate=4, speculate_max_batch=2)
    decoding(scheduler, *[make_request(i, 10, max_new_tokens=50) for i in range(3)])
    assert drafts(scheduler.schedule()) == {} and not scheduler.drafting()
    scheduler = make_scheduler(1000, speculate=4)
    opted_out = make_request(1, 10, max_new_tokens=50)
    opted_out.params.speculate = False
    decoding(scheduler, make_request(0, 10, max_new_tokens=50), opted_out)
    assert drafts(scheduler.schedule()) == {0: 4}


def test_a_request_whose_drafts_gain_nothing_backs_off():
    """No n-gram of its end recurs (every token new): from the second miss in a row the request
    sits out 1, 3, 7, then 15 steps between lookups, and meanwhile the scheduler says no step
    drafts (the engine runs those with look-ahead). A draft the model accepts none of is a miss
    too, if its match was 2 tokens or more; one with a token accepted puts the request back to
    drafting every step."""
    scheduler = make_scheduler(1000, speculate=4)
    req = Request(req_id=0, prompt_token_ids=list(range(100, 120)), params=SamplingParams(max_new_tokens=200))
    scheduler.add_request(req)
    run_step(scheduler)                                 # the prefill; its token is TOKEN, new
    lookups, fresh = [], iter(range(1000, 2000))
    for step in range(64):
        looked = scheduler.drafting()
        output = scheduler.schedule()
        assert drafts(output) == {}
        scheduler.update_after_step(output)
        req.append_token(next(fresh))
        if looked:
            lookups.append(step)
    assert lookups == [0, 1, 3, 7, 15, 31, 47, 63]
    assert req.num_draft_misses == 8 and req.draft_wait == 15

    def verified(match_len: int, num_accepted: int) -> None:
        s = ScheduledRequest(req, 5, draft_token_ids=[1, 2, 3, 4], draft_match_len=match_len)
        scheduler.draft_verified(s, num_accepted)      # (the engine reports it)

    req.draft_wait = 0                                  # its wait over, it drafts again:
    verified(match_len=3, num_accepted=1)               # a token accepted: drafting every step again
    assert req.num_draft_misses == 0
    verified(match_len=1, num_accepted=0)               # a lone token's 2-token guess: no miss
    assert req.num_draft_misses == 0 and req.draft_wait == 0
    verified(match_len=2, num_accepted=0)
    verified(match_len=5, num_accepted=0)
    assert req.num_draft_misses == 2 and req.draft_wait == 1
    verified(match_len=1, num_accepted=0)
    assert req.num_draft_misses == 2 and req.draft_wait == 1


def test_a_draft_is_as_long_as_its_evidence():
    """Two draft tokens per matched token (prompt_lookup.py): a lone recurring token gets 2 at
    speculate=10, a long match all 10."""
    scheduler = make_scheduler(1000, speculate=10)
    req = Request(req_id=0, prompt_token_ids=list(range(1, 40)), params=SamplingParams(max_new_tokens=50))
    decoding(scheduler, req)             # its first token is TOKEN (7): "7" recurs, "39 7" does not
    [s] = scheduler.schedule().scheduled
    assert (s.draft_token_ids, s.draft_match_len) == ([8, 9], 1)
    scheduler = make_scheduler(1000, speculate=10)
    decoding(scheduler, make_request(0, 20, max_new_tokens=50))     # TOKEN repeated: a 20-token match
    assert drafts(scheduler.schedule()) == {0: 10}


@settings(max_examples=60, deadline=None)
@given(st.integers(40, 160), st.lists(st.tuples(st.integers(1, 30), st.integers(1, 40)), min_size=1, max_size=6),
       st.integers(0, 10))
def test_drafts_never_cause_a_preemption(pool, shapes, accept):
    """However much of each draft is kept (``accept`` tokens at most), the step after a step with
    drafts preempts nobody: the drafts left each running request its next decode's slot."""
    scheduler = make_scheduler(pool, speculate=6, max_prefill_tokens=64)
    for i, (p, n) in enumerate(shapes):
        if p < pool:
            scheduler.add_request(make_request(i, p, min(n, pool - p)))
    drafted = False
    while scheduler.has_unfinished():
        before = scheduler.num_preemptions
        output = scheduler.schedule()
        assert not (drafted and scheduler.num_preemptions > before)
        for s in output.scheduled:
            assert len(s.draft_token_ids) <= s.request.params.max_new_tokens - s.request.num_output_tokens - 1
        scheduler.update_after_step(output)
        assert scheduler.num_used_slots <= pool
        for s in output.scheduled:
            req = s.request
            kept = min(accept, len(s.draft_token_ids))
            req.num_cached -= len(s.draft_token_ids) - kept     # what the worker truncates
            if not s.samples:
                continue
            for token in [TOKEN] * (kept + 1):
                if req.append_token(token, eos_token_ids={EOS}) is not None:
                    scheduler.finish_request(req, req.finish_reason)
                    break
        drafted = output.num_draft_tokens > 0
        event(f"drafted: {drafted}")


# --------------------------------------------------------------------------------------
# The prefix cache's side of scheduling
# --------------------------------------------------------------------------------------


def prompt_request(req_id: int, prompt: list[int], max_new_tokens: int = 2) -> Request:
    return Request(req_id=req_id, prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=max_new_tokens),
                   arrival_time=float(req_id))


def run_until_idle(scheduler: Scheduler) -> None:
    while scheduler.has_unfinished():
        run_step(scheduler)


def test_waiting_requests_with_longer_cached_prefixes_go_first_within_an_age_bound():
    scheduler = make_scheduler(1000, prefix_cache=True, max_running_requests=1, prefix_wait_steps=10)
    cached = list(range(100, 140))
    scheduler.add_request(prompt_request(0, cached))
    run_until_idle(scheduler)            # its tokens are in the tree now
    scheduler.add_request(prompt_request(1, [5] * 20))                 # older, nothing cached
    scheduler.add_request(prompt_request(2, cached[:30] + [6] * 5))    # younger, 30 tokens cached
    scheduler.add_request(prompt_request(3, cached + [7]))             # youngest, 40 tokens cached
    order = []
    while scheduler.has_unfinished():
        output = run_step(scheduler)
        order += [s.request.req_id for s in output.scheduled if s.request.req_id not in order]
    # 3 then 2 jump the queue (one request runs at a time, for 2 steps each: 1 waits 4 steps, less
    # than the bound).
    assert order == [3, 2, 1]
    assert scheduler.num_cache_hit_tokens == 40 + 30


def test_the_age_bound_stops_cached_requests_from_starving_an_old_one():
    scheduler = make_scheduler(1000, prefix_cache=True, max_running_requests=1, prefix_wait_steps=3)
    cached = list(range(100, 140))
    scheduler.add_request(prompt_request(0, cached))
    run_until_idle(scheduler)
    scheduler.add_request(prompt_request(1, [5] * 20))
    order, next_id = [], 2
    for _ in range(12):                 # a stream of younger requests that all hit the cache
        scheduler.add_request(prompt_request(next_id, cached + [next_id]))
        next_id += 1
        output = run_step(scheduler)
        order += [s.request.req_id for s in output.scheduled if s.request.req_id not in order]
    assert 1 in order and order.index(1) <= 3


def test_eviction_comes_before_preemption_and_a_preempted_request_keeps_the_trees_share():
    # A pool of 60: one request's 40 cached tokens fill most of it once it finishes.
    scheduler = make_scheduler(60, prefix_cache=True)
    first = list(range(100, 140))
    scheduler.add_request(prompt_request(0, first, max_new_tokens=1))
    run_until_idle(scheduler)
    assert scheduler.num_cached_slots == 40 and scheduler.num_used_slots == 0 and scheduler.num_free_slots == 20
    # A new request needs 30 slots: the tree gives up what it must, nothing is preempted.
    scheduler.add_request(prompt_request(1, list(range(300, 330)), max_new_tokens=20))
    output = run_step(scheduler)
    assert [s.request.req_id for s in output.scheduled] == [1] and not output.preempted
    assert scheduler.cache.num_evicted_tokens == 40 and scheduler.num_preemptions == 0
    # It decodes until the pool is full, then a second one arrives and is preempted in its turn:
    # what it computed stays in the tree, and it comes back to it.
    scheduler.add_request(prompt_request(2, list(range(500, 520)), max_new_tokens=30))
    preempted = []
    while scheduler.has_unfinished():
        output = run_step(scheduler)
        preempted += output.preempted
        for s in output.scheduled:
            if s.request in preempted and s.request.num_cached_prefix:
                assert s.num_new_tokens < s.request.num_tokens   # re-prefilled from its cached tokens
    assert preempted and scheduler.num_used_slots == 0
    assert scheduler.num_free_slots + scheduler.num_cached_slots == 60


def test_admission_evicts_nothing_when_eviction_cannot_make_room():
    scheduler = make_scheduler(100, prefix_cache=True)
    scheduler.add_request(prompt_request(0, list(range(100, 140)), max_new_tokens=1))
    run_until_idle(scheduler)
    assert scheduler.num_cached_slots == 40
    scheduler.add_request(prompt_request(1, list(range(300, 330)), max_new_tokens=50))
    run_step(scheduler)
    # 75 prompt tokens: more than the free slots and the cache's 40 together while request 1 runs
    scheduler.add_request(prompt_request(2, list(range(500, 575)), max_new_tokens=5))
    run_step(scheduler)
    assert scheduler.num_waiting == 1 and scheduler.cache.num_evicted_tokens == 0 and scheduler.num_cached_slots == 40
