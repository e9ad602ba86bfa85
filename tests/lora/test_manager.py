"""The engine core's adapter slots: loads on first use, holds while running, LRU eviction of
unheld slots only, and a request that waits when every slot is held."""

from __future__ import annotations

from llmserve.lora.manager import LoadAdapter, LoraManager


def test_slots_load_hold_and_evict_least_recently_used():
    m = LoraManager({"a": "/a", "b": "/b", "c": "/c"}, max_loras=2)
    assert m.acquire("a") == 0 and m.acquire("b") == 1
    assert m.take_loads() == [LoadAdapter(0, "a", "/a"), LoadAdapter(1, "b", "/b")]
    assert m.acquire("a") == 0 and m.take_loads() == []          # resident: no load
    assert m.acquire("c") is None                                 # both slots held
    m.release(1)                                                  # b's request ends
    assert m.acquire("c") == 1 and m.take_loads() == [LoadAdapter(1, "c", "/c")]
    m.release(0), m.release(0)
    m.release(1)
    # a was used before c: a goes first
    assert m.acquire("b") == 0 and m.resident == ["c", "b"]


def test_unregister_waits_for_holders_and_a_new_registration_has_a_new_id():
    m = LoraManager({"a": "/a"}, max_loras=1)
    first = m.ids["a"]
    slot = m.acquire("a")
    assert not m.unregister("a")
    m.release(slot)
    assert m.unregister("a") and m.resident == []
    m.register("a", "/a2")
    assert m.ids["a"] != first and m.acquire("a") == 0 and m.take_loads()[-1] == LoadAdapter(0, "a", "/a2")
