"""The data-parallel router's rule (router.py), without a server."""

from __future__ import annotations

from llmserve.server.router import CacheAwareRouter

B = 4      # tokens a block, small so that the prompts here stay short


def router(replicas: int = 2, capacity_tokens: int = 1000, max_imbalance: int = 2) -> CacheAwareRouter:
    return CacheAwareRouter(replicas, capacity_tokens, block_tokens=B, max_imbalance=max_imbalance)


def test_no_match_goes_to_the_least_loaded_replica():
    r = router(3)
    assert r.route(list(range(8)), loads=[2, 0, 1]) == 1
    assert r.route(list(range(100, 108)), loads=[1, 1, 1]) == 0      # the lowest index among equals


def test_a_shared_prefix_follows_the_replica_that_has_it():
    r = router()
    system = list(range(12))
    first = r.route(system + [50, 51, 52, 53], loads=[1, 0])
    assert first == 1
    assert r.route(system + [60, 61], loads=[0, 1]) == 1               # the match beats a lighter load
    assert r.match_length(1, system + [70]) == 12 and r.match_length(0, system) == 0
    # The longest match wins over a shorter one.
    r.route(system[:4] + [9, 9, 9, 9], loads=[0, 5])                   # replica 0 has the first block only
    assert r.route(system + [80], loads=[0, 1]) == 1


def test_a_busy_replica_with_the_match_sends_the_prefix_to_another():
    r = router(max_imbalance=2)
    prompt = list(range(16))
    assert r.route(prompt, loads=[0, 0]) == 0
    assert r.route(prompt, loads=[2, 0]) == 0          # 2 beyond the least loaded: still within the bound
    assert r.route(prompt, loads=[3, 0]) == 1          # 3 beyond: the prefix spreads to replica 1
    assert r.route(prompt, loads=[3, 1]) == 1          # now both hold it: the least loaded of them


def test_an_adapters_prefixes_are_its_own():
    r = router()
    prompt = list(range(8))
    assert r.route(prompt, loads=[0, 0], lora_name="a") == 0
    assert r.match_length(0, prompt, lora_name="a") == 8
    assert r.match_length(0, prompt) == 0 and r.match_length(0, prompt, lora_name="b") == 0


def test_a_session_stays_on_its_replica_until_it_ends():
    r = router()
    assert r.route(list(range(8)), loads=[1, 0], session_id="s") == 1
    assert r.route(list(range(200, 240)), loads=[0, 9], session_id="s") == 1    # however busy, no match needed
    assert r.end_session("s") == 1
    assert r.end_session("s") is None
    assert r.route(list(range(300, 308)), loads=[0, 9], session_id="s") == 0


def test_a_replica_forgets_its_least_recently_used_prefixes_first():
    r = router(capacity_tokens=3 * B)                    # three blocks a replica
    old, new = list(range(2 * B)), list(range(100, 100 + 2 * B))
    r.route(old, loads=[0, 0])
    r.route(new, loads=[0, 0])
    assert r.match_length(0, new) == 2 * B
    assert r.match_length(0, old) == B                   # its deeper block went first, its start stays
