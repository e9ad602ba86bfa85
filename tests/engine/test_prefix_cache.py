"""The prefix cache (``llmserve.engine.prefix_cache``): first its side of scheduling on a bare
scheduler (cache-aware admission order, eviction before preemption), then end to end through the
engine: what it serves from the cache gives exactly the tokens a full prefill gives (greedy, the
tiny Llama against an engine without the cache), it leaks no KV slot, and session pins hold.

The cached engine has a small KV pool and prefill budget, so the workloads below also run under
eviction, preemption and chunked prefill; each runs with the plain and the overlapped step loop.
"""

from __future__ import annotations

import os
import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.request import Request
from llmserve.engine.scheduler import Scheduler
from llmserve.worker.model_worker import ModelWorker
from llmserve.worker.protocol import WorkerInitArgs
from scheduling_utils import make_scheduler, run_step

DTYPE = os.environ.get("LLMSERVE_TEST_DTYPE")
KV_TOKENS = 400        # small: the pressure workload outgrows it
PREFILL_TOKENS = 48    # small: longer prompts are chunked, after a cached prefix too
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


# --------------------------------------------------------------------------------------
# Scheduling: admission order, eviction
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
    assert scheduler.prefix_cache.num_hit_tokens == 40 + 30


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
    assert scheduler.prefix_cache.tree.num_evicted_tokens == 40 and scheduler.num_preemptions == 0
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
    assert scheduler.num_waiting == 1 and scheduler.prefix_cache.tree.num_evicted_tokens == 0 and scheduler.num_cached_slots == 40


# --------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cached(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype=DTYPE, max_total_token_num=KV_TOKENS, max_prefill_tokens=PREFILL_TOKENS) as llm:
        yield llm


@pytest.fixture(scope="module")
def uncached(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype=DTYPE, max_total_token_num=4096, prefix_cache=False) as llm:
        yield llm


@pytest.fixture(params=[False, True], ids=["plain", "overlap"])
def loop(cached, request):
    """``cached``, cold, with the plain or the overlapped step loop."""
    cached.engine.overlap = request.param
    cached.reset_prefix_cache()
    yield cached
    cached.engine.overlap = False
    assert not cached.engine.has_unfinished() and cached.engine.scheduler.num_used_slots == 0


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def check(llm: LLM, uncached: LLM, prompts: list[list[int]], params=GREEDY, expected=None) -> list[int]:
    """Run the prompts together on both engines (or take ``uncached``'s ``expected`` outputs):
    the same tokens. Returns each prompt's tokens taken from the cache."""
    got = llm.generate(prompts, params)
    expected = expected or uncached.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(o.num_cached_tokens == 0 for o in expected)
    return [o.num_cached_tokens for o in got]


def test_cache_hits_give_the_tokens_of_a_full_prefill(loop, uncached):
    rng = random.Random(0)
    vocab = loop.engine.info.vocab_size
    base = tokens(rng, 60, vocab)
    assert check(loop, uncached, [base]) == [0]
    assert check(loop, uncached, [base]) == [59], "a repeated prompt: all but its last token"
    # Shared prefixes of different lengths, ending inside the cached prompt's node (which splits),
    # together in one step.
    prompts = [base[:k] + tokens(rng, 5, vocab) for k in (10, 25, 37)] + [base[:37]]
    assert check(loop, uncached, prompts) == [10, 25, 37, 36]
    # The next turn of a conversation: the previous prompt, its answer, and more.
    (answer,) = loop.generate([base], GREEDY)
    turn = base + answer.token_ids + tokens(rng, 6, vocab)
    assert check(loop, uncached, [turn]) == [len(base) + len(answer.token_ids) - 1]
    # Concurrent requests sharing a prefix not cached yet arrive in one step: no hit for any of
    # them (each prefills it), and all of them cached the next time.
    shared = tokens(rng, 12, vocab)
    prompts = [shared + tokens(rng, 3, vocab) for _ in range(3)]    # 45 tokens: one step's budget
    assert check(loop, uncached, prompts) == [0, 0, 0]
    assert check(loop, uncached, [shared + [7]]) == [12]
    # A prompt longer than the prefill budget after its cached prefix: the rest is chunked.
    assert check(loop, uncached, [base + tokens(rng, 2 * PREFILL_TOKENS, vocab)]) == [60]


def test_prompt_logprobs_skip_the_cache_but_fill_it(loop, uncached):
    rng = random.Random(1)
    prompt = tokens(rng, 40, loop.engine.info.vocab_size)
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)
    check(loop, uncached, [prompt])
    got = loop.generate([prompt], params)[0]
    assert got.num_cached_tokens == 0 and len(got.prompt_logprobs) == len(prompt)
    assert got.prompt_logprobs[1:] == pytest.approx(uncached.generate([prompt], params)[0].prompt_logprobs[1:], abs=1e-5)
    assert check(loop, uncached, [prompt + [3]]) == [40]


def test_eviction_and_preemption_under_a_small_pool(cached, uncached):
    # Groups of prompts sharing prefixes, more than the pool holds at once: the tree evicts, and
    # running requests are preempted and come back to their cached tokens. (The overlapped loop
    # under preemption, with the cache, is tests/engine/test_overlap.py's.)
    loop = cached
    loop.reset_prefix_cache()
    rng = random.Random(2)
    vocab = loop.engine.info.vocab_size
    heads = [tokens(rng, n, vocab) for n in (50, 70, 90)]
    # Short prompts that generate long: admitted together, their decodes outgrow the pool.
    prompts = [rng.choice(heads)[: rng.randrange(15, 30)] + tokens(rng, rng.randrange(1, 6), vocab) for _ in range(11)]
    params = [SamplingParams(max_new_tokens=rng.choice([40, 60]), temperature=0, ignore_eos=True) for _ in prompts]
    scheduler = loop.engine.scheduler
    evicted, preemptions = scheduler.prefix_cache.tree.num_evicted_tokens, scheduler.num_preemptions
    expected = uncached.generate(prompts, params)
    for _ in range(2):
        hits = check(loop, uncached, prompts, params, expected)
    assert sum(hits) > 0
    assert scheduler.prefix_cache.tree.num_evicted_tokens > evicted, "the workload should fill the pool"
    assert scheduler.num_preemptions > preemptions, "the workload should outgrow the pool"


def test_no_slot_leaks_after_random_requests_and_aborts(cached):
    """200 requests with random shared prefixes, a fifth of them aborted at random points, on an
    in-process worker whose KV pool we can read: every slot ends free or held by the tree alone
    (with one reference per node position), and a full eviction frees them all."""
    engine = cached.engine
    cached.reset_prefix_cache()
    worker = ModelWorker(WorkerInitArgs(
        model_path=engine.model_path, model_type=engine.info.model_type, rank=0, world_size=1,
        device=engine.info.device, dtype=DTYPE, max_total_token_num=KV_TOKENS,
        max_running_requests=engine.config.max_running_requests, eos_token_ids=sorted(engine.eos_token_ids),
    ))
    real_workers, engine.workers = engine.workers, worker
    rng = random.Random(3)
    vocab = engine.info.vocab_size
    heads = [tokens(rng, 40, vocab) for _ in range(4)]
    try:
        live: list[int] = []
        for i in range(200):
            engine.overlap = i % 50 >= 25        # both loops, switched only when idle
            prompt = rng.choice(heads)[: rng.randrange(1, 40)] + tokens(rng, rng.randrange(1, 8), vocab)
            params = SamplingParams(max_new_tokens=rng.randrange(1, 6), temperature=0, ignore_eos=True)
            live.append(engine.add_request(prompt, params).req_id)
            for _ in range(rng.randrange(0, 3)):
                engine.step()
            if rng.random() < 0.2:
                engine.abort_request(live.pop(rng.randrange(len(live))))
            if i % 25 == 24:
                while engine.has_unfinished():
                    engine.step()
                engine.flush()
        while engine.has_unfinished():
            engine.step()
        engine.flush()
        mem = worker.model.mem_manager
        tree = {}
        for slots in worker.prefix_slots.node_slots.values():
            for slot in slots.tolist():
                tree[slot] = tree.get(slot, 0) + 1
        assert not worker.req_rows and engine.scheduler.num_used_slots == 0
        assert {i: c for i, c in enumerate(mem.ref_counts.tolist()) if c} == tree
        assert len(tree) == engine.scheduler.prefix_cache.tree.num_tokens > 0
        assert engine.scheduler.prefix_cache.num_hit_tokens > 0
        cached.reset_prefix_cache()
        assert mem.can_use_mem_size == mem.size
        assert int(mem.ref_counts.sum()) == 0 and not worker.prefix_slots.node_slots
    finally:
        engine.overlap = False
        cached.reset_prefix_cache()
        engine.workers = real_workers


def run_alone(engine, prompt: list[int], session_id: str | None = None):
    req = engine.add_request(prompt, GREEDY, session_id=session_id)
    while engine.has_unfinished():
        engine.step()
    engine.flush()
    return req


def test_a_session_pin_outlives_lru_eviction_until_the_session_ends_then_lru_may_take_it(cached):
    engine, scheduler = cached.engine, cached.engine.scheduler
    cached.reset_prefix_cache()
    rng = random.Random(4)
    vocab = engine.info.vocab_size
    first = run_alone(engine, tokens(rng, 60, vocab), session_id="s1")
    kept = first.num_tokens - 1          # all but the answer's last token, which no step fed
    assert scheduler.prefix_cache.tree.num_pinned_tokens == kept == scheduler.num_cached_slots
    # Other traffic overfills the pool: the cache evicts the traffic's own entries, not the session's.
    evicted = scheduler.prefix_cache.tree.num_evicted_tokens
    for _ in range(3):
        run_alone(engine, tokens(rng, 150, vocab))
    assert scheduler.prefix_cache.tree.num_evicted_tokens > evicted
    assert scheduler.prefix_cache.tree.prefix_length(first.cache_key(kept)) == kept
    second = run_alone(engine, first.all_token_ids + tokens(rng, 5, vocab), session_id="s1")
    assert second.num_cached_prefix == kept
    assert scheduler.prefix_cache.tree.num_pinned_tokens == second.num_tokens - 1   # the pin moved to the new turn
    cached_before = scheduler.num_cached_slots
    engine.end_session("s1")
    # Ended: the pin goes, and with it the conversation, which nothing else shares.
    tree = scheduler.prefix_cache.tree
    assert tree.num_pinned_tokens == 0 and not scheduler.prefix_cache.sessions
    assert scheduler.num_cached_slots == cached_before - (second.num_tokens - 1) == tree.num_evictable_tokens
    assert tree.prefix_length(second.cache_key(second.num_tokens - 1)) < 2


def test_ending_sessions_keeps_the_prefix_they_share_cached(cached):
    """Two sessions share a long system prompt: ending one leaves the other's next turn a full
    hit; a one-off request shares it too, so once both have ended the prompt stays cached while
    each session's own turns are gone."""
    engine, scheduler = cached.engine, cached.engine.scheduler
    cached.reset_prefix_cache()
    rng = random.Random(6)
    vocab = engine.info.vocab_size
    shared = tokens(rng, 80, vocab)
    one = run_alone(engine, shared + tokens(rng, 10, vocab), session_id="one")
    two = run_alone(engine, shared + tokens(rng, 10, vocab), session_id="two")
    assert two.num_cached_prefix == len(shared)
    engine.end_session("one")
    again = run_alone(engine, two.all_token_ids + tokens(rng, 5, vocab), session_id="two")
    assert again.num_cached_prefix == two.num_tokens - 1
    one_off = run_alone(engine, shared + tokens(rng, 10, vocab))
    assert one_off.num_cached_prefix == len(shared)
    engine.end_session("two")
    assert scheduler.prefix_cache.tree.num_pinned_tokens == 0
    fresh = run_alone(engine, shared + tokens(rng, 10, vocab))
    assert fresh.num_cached_prefix == len(shared)
    for ended in (one, again):
        assert scheduler.prefix_cache.tree.prefix_length(ended.cache_key(ended.num_tokens - 1)) < len(shared) + 2


def test_a_prompt_is_cached_once_prefilled_even_when_its_last_chunk_is_one_token(cached):
    engine = cached.engine
    cached.reset_prefix_cache()
    prompt = tokens(random.Random(5), PREFILL_TOKENS + 1, engine.info.vocab_size)
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    while req.num_output_tokens < 2:        # the chunks are done, it decodes
        engine.step()
    assert engine.scheduler.prefix_cache.tree.prefix_length(prompt) == len(prompt)
    engine.abort_request(req.req_id)
    engine.flush()
