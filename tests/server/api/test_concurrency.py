"""Many clients at once, end to end: concurrent greedy streams give the tokens they give alone;
clients that go away mid-request free everything they held; more requests than
--max-concurrent-requests get a quick 429 while the admitted ones complete."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from serving_utils import ServerProcess, tgi_stream_events

OVERALL_TIMEOUT_S = 90.0

PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "My favourite colour is",
    "In 1492, Columbus", "The quick brown fox", "To be or not to be", "Water boils at",
    "The best way to learn", "SELECT * FROM users WHERE", "Dear Sir or Madam,", "import numpy as np",
    "The mitochondria is", "Roses are red,", "How many legs does a spider", "Breaking news:",
]


def token_ids(events: list[dict]) -> list[int]:
    assert all("error" not in e for e in events), events
    assert events[-1]["details"] is not None, "the stream did not end with its final event"
    return [e["token"]["id"] for e in events]


def run(coro, timeout: float = OVERALL_TIMEOUT_S):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wait_for_metrics(server: ServerProcess, condition, timeout: float = 5.0) -> dict[str, float]:
    """Poll /metrics until ``condition(metrics)`` holds; fail with the last sample if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if condition(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics did not settle in {timeout} s: "
                                 f"{ {k: v for k, v in m.items() if not k.startswith('llmserve_time') and '_bucket' not in k} }")
        time.sleep(0.05)


def idle(m: dict[str, float]) -> bool:
    return (m["llmserve_kv_cache_slots_used"] == 0 and m["llmserve_queue_size"] == 0
            and m["llmserve_running_batch_size"] == 0 and m["llmserve_requests_in_flight"] == 0)


ABORTED = 'llmserve_requests_total{outcome="aborted"}'
OVERLOADED = 'llmserve_requests_total{outcome="overloaded"}'


def assert_serves(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": True}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] == 4


# -- (1) batching does not change greedy tokens ------------------------------------------

def test_concurrent_greedy_streams_match_alone(tiny_server):
    def body(prompt: str) -> dict:
        return {"inputs": prompt, "parameters": {"max_new_tokens": 24, "details": True}}

    async def alone() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return [token_ids(await tgi_stream_events(client, tiny_server.url, body(p))) for p in PROMPTS]

    async def together() -> list[list[int]]:
        limits = httpx.Limits(max_connections=len(PROMPTS))
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            results = await asyncio.gather(*(tgi_stream_events(client, tiny_server.url, body(p)) for p in PROMPTS))
        return [token_ids(events) for events in results]

    expected = run(alone())
    got = run(together())
    assert all(len(ids) == 24 for ids in expected)
    for prompt, want, have in zip(PROMPTS, expected, got):
        assert have == want, f"{prompt!r}: batched {have} != alone {want}"
    m = wait_for_metrics(tiny_server, idle)
    assert m["llmserve_kv_cache_slots_used"] == 0


# -- (2) clients that go away ------------------------------------------------------------

def test_disconnected_streams_are_aborted_and_free_their_kv(tiny_server):
    before = tiny_server.metrics()
    n = 20

    async def open_and_hang_up() -> list[list[dict]]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(
                tgi_stream_events(client, tiny_server.url, {"inputs": p, "parameters": {"max_new_tokens": 400}}, max_events=3)
                for p in (PROMPTS * 2)[:n]))

    results = run(open_and_hang_up())
    assert all(len(events) == 3 and all("token" in e for e in events) for events in results)
    # Every client hung up after 3 of 400 tokens: within a few seconds nothing is held any more.
    m = wait_for_metrics(tiny_server, lambda m: idle(m) and m[ABORTED] - before[ABORTED] >= n)
    assert m[ABORTED] - before[ABORTED] == n
    assert m['llmserve_requests_total{outcome="error"}'] == before['llmserve_requests_total{outcome="error"}']
    assert_serves(tiny_server)


def test_disconnects_among_shared_prefixes_leave_only_the_prefix_caches_slots(tiny_server):
    """The prefix cache under clients that hang up: 40 streams opening with one of four shared
    prefixes, every other one dropped after its second token. Once idle no running request holds a
    slot; what stays is the tree's (evictable), and later requests still hit it."""
    rng = random.Random(0)
    prefixes = [" ".join(rng.choice(PROMPTS) for _ in range(6)) for _ in range(4)]
    prompts = [f"{rng.choice(prefixes)} {rng.choice(PROMPTS)}" for _ in range(40)]
    before = tiny_server.metrics()

    async def some_hang_up() -> list[list[dict]]:
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(
                # A client that hangs up asks for 400 tokens: with 12 its request could end before the
                # server sees the hang-up (a success, not an abort), as a loaded CI machine once had it.
                tgi_stream_events(client, tiny_server.url,
                                  {"inputs": p, "parameters": {"max_new_tokens": 400 if i % 2 else 12}},
                                  max_events=2 if i % 2 else None)
                for i, p in enumerate(prompts)))

    results = run(some_hang_up())
    assert all(len(events) == (2 if i % 2 else 12) for i, events in enumerate(results))
    m = wait_for_metrics(tiny_server, lambda m: idle(m) and m[ABORTED] - before[ABORTED] == len(prompts) // 2)
    assert m["llmserve_kv_cache_slots_used"] == 0
    assert 0 < m["llmserve_kv_cache_slots_cached"] <= m["llmserve_kv_cache_slots_total"]
    hits = "llmserve_prefix_cache_hit_tokens_total"
    assert m[hits] - before[hits] > 0, "requests sharing prefixes hit the cache"
    assert_serves(tiny_server)


def test_non_streaming_request_whose_client_times_out_is_aborted(tiny_server):
    before = tiny_server.metrics()
    new_tokens = 500   # about as many as the tiny model's 512 positions allow: a second or more of steps
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": new_tokens}},
                   timeout=httpx.Timeout(60, read=0.25))
    m = wait_for_metrics(tiny_server, lambda m: idle(m) and m[ABORTED] > before[ABORTED])
    assert m[ABORTED] - before[ABORTED] == 1
    # it was stopped early, not run to its end
    assert m["llmserve_generated_tokens_total"] - before["llmserve_generated_tokens_total"] < new_tokens
    assert_serves(tiny_server)


# -- (3) overload ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def limited_server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--max-concurrent-requests", "4") as server:
        yield server


def test_requests_over_the_concurrency_limit_get_429(limited_server):
    n, limit, new_tokens = 16, 4, 64
    before = limited_server.metrics()

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as client:
            return await asyncio.gather(*(
                client.post(limited_server.url + "/generate",
                            json={"inputs": p, "parameters": {"max_new_tokens": new_tokens, "details": True}})
                for p in PROMPTS[:n]))

    start = time.monotonic()
    responses = run(fire())
    elapsed = time.monotonic() - start
    ok = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(rejected) == n, [(r.status_code, r.text) for r in responses]
    # all 16 arrive within milliseconds while each admitted one runs for 64 steps
    assert limit <= len(ok) < n and len(rejected) >= n - 2 * limit, (len(ok), len(rejected))
    for r in ok:
        assert r.json()["details"]["generated_tokens"] == new_tokens
    for r in rejected:
        assert r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    m = wait_for_metrics(limited_server, idle)
    assert m[OVERLOADED] - before[OVERLOADED] == len(rejected)
    assert elapsed < OVERALL_TIMEOUT_S
    assert_serves(limited_server)


def test_overloaded_streams_get_429_too(limited_server):
    n, limit = 8, 4

    async def fire():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as client:
            async def one(p: str):
                async with client.stream("POST", limited_server.url + "/generate_stream",
                                         json={"inputs": p, "parameters": {"max_new_tokens": 64, "details": True}}) as r:
                    body = await r.aread()
                    return r.status_code, body
            return await asyncio.gather(*(one(p) for p in PROMPTS[:n]))

    results = run(fire())
    codes = sorted(code for code, _ in results)
    assert codes.count(200) >= limit and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
    for code, body in results:
        if code == 429:
            assert json.loads(body)["error_type"] == "overloaded"
        else:
            events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
            assert events[-1]["details"]["generated_tokens"] == 64
    wait_for_metrics(limited_server, idle)
    assert_serves(limited_server)
