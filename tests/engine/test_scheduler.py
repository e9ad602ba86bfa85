"""Continuous batching: admission, FIFO order, limits, preemption, random workloads, and the
overlapped loop. (Drafts: test_drafting.py; the prefix cache's side: test_prefix_cache.py.)"""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmserve.engine.request import FinishReason, Request, RequestStatus
from llmserve.engine.scheduler import SchedulerOutput
from scheduling_utils import EOS, TOKEN, make_request, make_scheduler, run_step, scheduled_ids

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
