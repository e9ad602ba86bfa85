"""Speculation's policy (``llmserve.engine.drafting``) through the scheduler: who may draft, how
long a draft budget, within what room (the request's tokens in flight counted), and the back-off
of requests whose drafts gain nothing. (The drafts themselves are rank 0's: tests/worker's
test_prompt_lookup.py.)"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmserve.engine.drafting import DRAFT_COSTS, MAX_DRAFT_WAIT, MAX_SKIP_WAIT, PRIOR_ACCEPTANCE, DraftCost
from llmserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from llmserve.sampling_params import SamplingParams
from llmserve.worker.prompt_lookup import LONG_MATCH
from scheduling_utils import EOS, TOKEN, make_request, make_scheduler, run_step


def decoding(scheduler: Scheduler, *reqs: Request) -> None:
    """Prefill the requests and give each its first token: the next step decodes them."""
    for req in reqs:
        scheduler.add_request(req)
    run_step(scheduler)


def drafts(output: SchedulerOutput) -> dict[int, int]:
    return {s.request.req_id: s.draft_budget for s in output.scheduled if s.draft_budget}


def read(scheduler: Scheduler, s: ScheduledRequest, num_drafted: int, num_accepted: int, match_len: int = 5) -> None:
    """What the engine does once it reads a decode that had a budget: its slots go back, the
    tokens kept count as cached, the drafter learns the outcome, and the run is appended."""
    req = s.request
    req.num_draft_slots -= s.draft_budget
    req.num_cached += num_accepted
    scheduler.drafter.verified(s, num_drafted, match_len, num_accepted)
    for _ in range(num_accepted + 1):
        req.append_token(TOKEN)


def test_a_decode_gets_a_budget_of_up_to_k_whose_slots_it_holds_until_read():
    scheduler = make_scheduler(200, speculate=4)
    req = make_request(0, prompt_len=20, max_new_tokens=50)
    decoding(scheduler, req)
    output = scheduler.schedule()
    [s] = output.scheduled
    assert s.draft_budget == 4 and s.num_new_tokens == 1 and output.num_draft_slots == 4
    assert output.num_tokens == 1 and not s.prefill
    used = scheduler.num_used_slots
    scheduler.update_after_step(output)
    assert req.num_draft_slots == 4 and scheduler.num_used_slots == used + 1 + 4
    read(scheduler, s, num_drafted=3, num_accepted=2)
    assert req.num_draft_slots == 0 and scheduler.num_used_slots == used + 1 + 2 and req.num_cached == 20 + 1 + 2


def test_budgets_stop_short_of_max_new_tokens_the_kv_pool_and_the_token_budget():
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


def test_a_budget_counts_the_tokens_in_flight_and_retirement_only_the_certain_ones():
    """The overlapped loop schedules a request's next step before it reads the one with its draft:
    the new budget leaves room for all that draft may have added, and the request stays running
    (a plain decode) while its certain count is short of max_new_tokens."""
    scheduler = make_scheduler(200, speculate=4)
    req = make_request(0, 20, max_new_tokens=8)
    decoding(scheduler, req)                               # 1 output token
    first = scheduler.schedule()
    scheduler.update_after_step(first)
    req.num_pending_tokens += 1                            # (the engine's _sent)
    assert drafts(first) == {0: 4} and req.max_num_output_tokens == 1 + 1 + 4
    second = scheduler.schedule()                          # 8 - 6 - 1: a budget of 1
    assert drafts(second) == {0: 1} and not req.final_token_pending
    scheduler.update_after_step(second)
    req.num_pending_tokens += 1
    assert req.max_num_output_tokens == 8                  # the third step may find it done
    third = scheduler.schedule()
    assert drafts(third) == {} and [s.request for s in third.scheduled] == [req]


def test_no_drafts_for_large_batches_or_requests_that_opt_out():
    scheduler = make_scheduler(1000, speculate=4, speculate_max_batch=2)
    decoding(scheduler, *[make_request(i, 10, max_new_tokens=50) for i in range(3)])
    assert drafts(scheduler.schedule()) == {}
    scheduler = make_scheduler(1000, speculate=4)
    opted_out = make_request(1, 10, max_new_tokens=50)
    opted_out.params.speculate = False
    decoding(scheduler, make_request(0, 10, max_new_tokens=50), opted_out)
    assert drafts(scheduler.schedule()) == {0: 4}


def test_a_request_whose_drafts_gain_nothing_backs_off():
    """Its lookups find nothing (the worker drafts no token): from the second miss in a row the
    request sits out 1, 3, 7, then 15 steps between budgets. A draft the model accepts none of is
    a miss too, if its match was 2 tokens or more; one with a token accepted puts the request back
    to drafting every step."""
    scheduler = make_scheduler(1000, speculate=4)
    req = make_request(0, 20, max_new_tokens=200)
    decoding(scheduler, req)
    granted = []
    for step in range(64):
        output = scheduler.schedule()
        [s] = output.scheduled
        scheduler.update_after_step(output)
        if s.draft_budget:
            granted.append(step)
            read(scheduler, s, num_drafted=0, num_accepted=0)
        else:
            req.append_token(TOKEN)
    assert granted == [0, 1, 3, 7, 15, 31, 47, 63]
    state = scheduler.drafter.states[req]
    assert state.num_misses == 8 and state.wait == 15

    def verified(match_len: int, num_accepted: int) -> None:
        s = ScheduledRequest(req, 1, draft_budget=4)
        scheduler.drafter.verified(s, 4, match_len, num_accepted)    # (the engine reports it)

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


def test_the_draft_length_that_pays():
    """Without a cost a draft is as long as k; with the CPU's, as long as the acceptance makes it
    pay: the longer the likelier its tokens are kept, never past k, and none where no draft beats
    a plain decode."""
    assert [DraftCost().best_length(a, 10) for a in (0.05, 0.5, 1.0)] == [10, 10, 10]
    cpu = DRAFT_COSTS["cpu"]
    lengths = [cpu.best_length(a / 20, 10) for a in range(21)]
    assert lengths == sorted(lengths) and lengths[0] == 0 and lengths[-1] == 10
    assert 1 <= cpu.best_length(0.4, 10) <= 2 and cpu.best_length(0.95, 10) == 10
    assert cpu.best_length(0.95, 4) == 4 and cpu.best_length(0.5, 0) == 0


def expected_rate(cost: DraftCost, acceptances: list[float], lengths: list[int]) -> float:
    """Tokens a step is expected to emit per unit of its cost (DraftCost's model)."""
    emitted = sum(1 + sum(a ** n for n in range(1, k + 1)) for a, k in zip(acceptances, lengths))
    step = 1 + cost.per_request * (len(lengths) - 1)
    if any(lengths):
        step += cost.per_step + cost.per_request_verified * len(lengths) + cost.per_token * sum(lengths)
    return emitted / step


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 10)), min_size=1, max_size=8), st.data())
def test_a_steps_draft_lengths_pay_best(decodes, data):
    """Over the step's decodes together, no other lengths within the limits are expected to emit
    more tokens per unit of step time than those chosen."""
    cpu = DRAFT_COSTS["cpu"]
    acceptances, limits = [a for a, _ in decodes], [k for _, k in decodes]
    lengths = cpu.draft_lengths(acceptances, limits)
    assert all(0 <= n <= k for n, k in zip(lengths, limits))
    other = [data.draw(st.integers(0, k)) for k in limits]
    assert expected_rate(cpu, acceptances, other) <= expected_rate(cpu, acceptances, lengths) + 1e-9


def test_a_large_batch_drafts_only_what_pays_for_its_verify():
    """On a CPU every row of a step costs: at batch 8 the verify path and the draft rows pay only
    for drafts likely kept, so requests whose drafts fail draft nothing, and a lone good copier
    among them drafts only if its tokens cover the step's verify."""
    cpu = DRAFT_COSTS["cpu"]
    assert cpu.draft_lengths([0.5] * 8, [10] * 8) == [0] * 8
    assert cpu.best_length(0.5, 10) > 0           # what pays alone does not at batch 8
    assert cpu.draft_lengths([0.9] + [0.2] * 7, [10] * 8) == [0] * 8
    copying = cpu.draft_lengths([0.95, 0.95, 0.95, 0.2, 0.2, 0.2, 0.2, 0.2], [10] * 8)
    assert copying[:3] == [copying[0]] * 3 and copying[0] >= 5 and copying[3:] == [0] * 5
    assert DraftCost().draft_lengths([0.1, 0.0, 1.0], [3, 4, 0]) == [3, 4, 0]    # no cost: every limit


def test_a_requests_budgets_follow_what_it_accepted():
    """A request whose drafts are rejected at their first token gets shorter budgets, then none
    for a while (its evidence fading meanwhile); drafts accepted whole bring it back to all of k."""
    scheduler = make_scheduler(1000, speculate=10, draft_cost=DRAFT_COSTS["cpu"])
    req = make_request(0, 20, max_new_tokens=200)
    decoding(scheduler, req)
    lengths = []

    def step(accept_all: bool) -> None:
        output = scheduler.schedule()
        [s] = output.scheduled
        lengths.append(s.draft_budget)
        scheduler.update_after_step(output)
        if s.draft_budget:
            read(scheduler, s, s.draft_budget, s.draft_budget if accept_all else 0)
        else:
            req.append_token(TOKEN)
        scheduler.drafter.states[req].num_misses = 0     # (no back-off: the test above's)

    for _ in range(4):
        step(accept_all=False)
    assert lengths[0] > lengths[1] >= lengths[2] and lengths[2] <= 2 and lengths[3] == 0
    for _ in range(12):
        step(accept_all=True)
    drafted = [n for n in lengths[4:] if n]
    assert drafted == sorted(drafted) and drafted[-1] == 10


def test_free_texts_failing_guesses_back_off_like_misses():
    """Free text: each draft continues a lone recurring token (match 1: no miss in `verified`) and
    is rejected. Left out for an acceptance that would not pay even alone, the request backs off
    as after misses, up to MAX_DRAFT_WAIT steps while none of its draft tokens was ever accepted,
    so it verifies rarely (13 steps of 200 here; 58 while skips only faded its evidence, 21 with
    waits of up to MAX_SKIP_WAIT, the cap once a draft was accepted: waits of 15 there cost answers
    that copy their own loops their loops' starts); one accepted draft puts it back to drafting
    every step."""
    scheduler = make_scheduler(2000, speculate=10, draft_cost=DRAFT_COSTS["cpu"])
    req = make_request(0, 20, max_new_tokens=1000)
    decoding(scheduler, req)

    def step(accept: bool) -> int:
        output = scheduler.schedule()
        [s] = output.scheduled
        scheduler.update_after_step(output)
        if s.draft_budget:
            read(scheduler, s, min(s.draft_budget, 2), min(s.draft_budget, 2) if accept else 0, match_len=1)
        else:
            req.append_token(TOKEN)
        return bool(s.draft_budget)

    def gaps(verifies: list[bool]) -> list[int]:
        at = [i for i, v in enumerate(verifies) if v]
        return [b - a for a, b in zip(at, at[1:])]

    verifies = [step(accept=False) for _ in range(200)]
    state = scheduler.drafter.states[req]
    assert 3 <= sum(verifies) <= 16 and state.num_misses >= 4
    assert max(gaps(verifies)) > MAX_SKIP_WAIT + 2 and set(gaps(verifies[100:])) == {MAX_DRAFT_WAIT + 2}
    while not step(accept=True):     # its next try is accepted: no waits after it
        pass
    assert state.num_misses == 0 and all(step(accept=True) for _ in range(5))
    # Once a draft of it was accepted, its failing guesses wait MAX_SKIP_WAIT steps at a time
    # (twice in a row where its evidence has not faded enough after one wait).
    verifies = [step(accept=False) for _ in range(200)]
    assert set(gaps(verifies[100:])) <= {MAX_SKIP_WAIT + 2, 2 * MAX_SKIP_WAIT + 3} and sum(verifies[100:]) >= 7


def test_a_long_match_ends_a_back_off_once_a_copy():
    """A request backed off after failed guesses (free text, or an answer between its loops) drafts
    at once when rank 0 reports a match of LONG_MATCH tokens (a copy under way), planned at the
    prior's acceptance at least. If that copy's draft is rejected whole, the match stops being
    evidence (the back-off holds) until a shorter match ends the copy; the next long one ends the
    back-off again."""
    scheduler = make_scheduler(2000, speculate=10, draft_cost=DRAFT_COSTS["cpu"])
    req = make_request(0, 20, max_new_tokens=1000)
    decoding(scheduler, req)
    drafter = scheduler.drafter

    def step(match_len: int, accepted: int = 0) -> int:
        """One decode step; a draft is read with ``accepted`` of its tokens kept. Then rank 0's
        report of the request's match. Returns the step's budget."""
        output = scheduler.schedule()
        [s] = output.scheduled
        scheduler.update_after_step(output)
        if s.draft_budget:
            read(scheduler, s, s.draft_budget, min(accepted, s.draft_budget), match_len=drafter.states[req].match_len)
        else:
            req.append_token(TOKEN)
        drafter.matched(req, match_len)
        return s.draft_budget

    for _ in range(60):            # guesses from lone tokens, all rejected: a long back-off
        step(match_len=1)
    state = drafter.states[req]
    assert state.wait >= MAX_SKIP_WAIT and state.acceptance < PRIOR_ACCEPTANCE
    step(match_len=LONG_MATCH - 1)
    assert not step(match_len=LONG_MATCH - 1) and state.wait > 0      # a short match changes nothing
    step(match_len=LONG_MATCH)
    budget = step(match_len=LONG_MATCH + 1)                           # the wait is over at once
    assert budget >= DRAFT_COSTS["cpu"].best_length(PRIOR_ACCEPTANCE, 10) and state.copy_failed
    # That copy's draft was rejected whole: its long match no longer ends the back-off ...
    assert state.wait and not any(step(match_len=LONG_MATCH + 2) for _ in range(state.wait))
    # ... until the copy ends (a short match) and another starts, which drafts and is kept.
    step(match_len=2)
    step(match_len=LONG_MATCH)
    assert step(match_len=LONG_MATCH + 1, accepted=10) and state.num_misses == 0 and not state.copy_failed
    assert all(step(match_len=LONG_MATCH + 2, accepted=10) for _ in range(5))


def test_requests_without_speculation_keep_no_draft_state():
    scheduler = make_scheduler(200, speculate=4)
    req = make_request(0, 20, max_new_tokens=50)
    req.params = SamplingParams(max_new_tokens=50, speculate=False)
    scheduler.drafter.matched(req, LONG_MATCH)
    assert req not in scheduler.drafter.states


@settings(max_examples=60, deadline=None)
@given(st.integers(40, 160), st.lists(st.tuples(st.integers(1, 30), st.integers(1, 40)), min_size=1, max_size=6),
       st.integers(0, 10))
def test_drafts_never_cause_a_preemption(pool, shapes, accept):
    """However much of each draft is kept (``accept`` tokens at most), the step after a step with
    drafts preempts nobody: the budgets left each running request its next decode's slot."""
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
            assert s.draft_budget <= s.request.params.max_new_tokens - s.request.num_output_tokens - 1
        scheduler.update_after_step(output)
        assert scheduler.num_used_slots <= pool
        for s in output.scheduled:
            req = s.request
            kept = min(accept, s.draft_budget)
            req.num_draft_slots -= s.draft_budget
            req.num_cached += kept
            if not s.samples:
                continue
            for token in [TOKEN] * (kept + 1):
                if req.append_token(token, eos_token_ids={EOS}) is not None:
                    scheduler.finish_request(req, req.finish_reason)
                    break
        drafted = output.num_draft_slots > 0
        event(f"drafted: {drafted}")
