"""Speculation's policy (``llmserve.engine.drafting``) through the scheduler: who drafts, how
long a draft, within what room, and the back-off of requests whose drafts gain nothing."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmserve.engine.drafting import DRAFT_COSTS, DraftCost
from llmserve.engine.request import Request
from llmserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from llmserve.sampling_params import SamplingParams
from scheduling_utils import EOS, TOKEN, make_request, make_scheduler, run_step


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
    state = scheduler.drafter.states[req]
    assert state.num_misses == 8 and state.wait == 15

    def verified(match_len: int, num_accepted: int) -> None:
        s = ScheduledRequest(req, 5, draft_token_ids=[1, 2, 3, 4], draft_match_len=match_len)
        scheduler.drafter.verified(s, num_accepted)    # (the engine reports it)

    state.wait = 0                                      # its wait over, it drafts again:
    verified(match_len=3, num_accepted=1)               # a token accepted: drafting every step again
    assert state.num_misses == 0
    verified(match_len=1, num_accepted=0)               # a lone token's 2-token guess: no miss
    assert state.num_misses == 0 and state.wait == 0
    verified(match_len=2, num_accepted=0)
    verified(match_len=5, num_accepted=0)
    assert state.num_misses == 2 and state.wait == 1
    verified(match_len=1, num_accepted=0)
    assert state.num_misses == 2 and state.wait == 1


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


def test_the_draft_length_that_pays():
    """Without a cost a draft is as long as k; with the CPU's, as long as the acceptance makes it
    pay: the longer the likelier its tokens are kept, never past k, and none where no draft beats
    a plain decode."""
    assert [DraftCost().best_length(a, 10) for a in (0.05, 0.5, 1.0)] == [10, 10, 10]
    cpu = DRAFT_COSTS["cpu"]
    lengths = [cpu.best_length(a / 20, 10) for a in range(21)]
    assert lengths == sorted(lengths) and lengths[0] == 0 and lengths[-1] == 10
    assert 1 <= cpu.best_length(0.35, 10) <= 2 and cpu.best_length(0.95, 10) == 10
    assert cpu.best_length(0.95, 4) == 4 and cpu.best_length(0.5, 0) == 0


def test_a_requests_drafts_follow_what_it_accepted():
    """A request whose drafts are rejected at their first token drafts shorter, then none for a
    while (its evidence fading meanwhile); drafts accepted whole bring it back to all of k."""
    scheduler = make_scheduler(1000, speculate=10, draft_cost=DRAFT_COSTS["cpu"])
    req = make_request(0, 20, max_new_tokens=200)       # TOKEN repeated: every draft matches 20 tokens
    decoding(scheduler, req)
    lengths = []

    def step(accept_all: bool) -> None:
        output = scheduler.schedule()
        [s] = output.scheduled
        lengths.append(len(s.draft_token_ids))
        scheduler.update_after_step(output)
        num_accepted = len(s.draft_token_ids) if accept_all else 0
        req.num_cached -= len(s.draft_token_ids) - num_accepted
        if s.draft_token_ids:                            # (the engine reports verified drafts)
            scheduler.drafter.verified(s, num_accepted)
        scheduler.drafter.states[req].num_misses = 0     # (no back-off: the test above's)
        for _ in range(num_accepted + 1):
            req.append_token(TOKEN)

    for _ in range(4):
        step(accept_all=False)
    assert lengths[0] > lengths[1] >= lengths[2] and lengths[2] <= 2 and lengths[3] == 0
    for _ in range(12):
        step(accept_all=True)
    drafted = [n for n in lengths[4:] if n]
    assert drafted == sorted(drafted) and drafted[-1] == 10


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
