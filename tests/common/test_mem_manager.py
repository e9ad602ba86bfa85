"""MemoryManager / ReqManager: unit tests plus a stateful property test against a Python model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmserve.common.mem_manager import (
    KVCacheFullError,
    MemoryManager,
    ReqManager,
    TooManyRequestsError,
)


def make_mem(size: int = 16) -> MemoryManager:
    return MemoryManager(size=size, dtype=torch.float16, head_num=2, head_dim=4, layer_num=3)


def snapshot(mem: MemoryManager) -> tuple[int, list[int]]:
    return mem.can_use_mem_size, mem.ref_counts.tolist()


# ---------------------------------------------------------------------------------------------
# MemoryManager


def test_buffers_have_the_contract_shapes() -> None:
    mem = make_mem(10)
    assert mem.size == 10
    assert len(mem.key_buffer) == len(mem.value_buffer) == 3
    for buf in mem.key_buffer + mem.value_buffer:
        assert buf.shape == (10, 2, 4) and buf.dtype == torch.float16 and buf.device.type == "cpu"
    # Each layer has its own storage.
    assert mem.key_buffer[0].data_ptr() != mem.key_buffer[1].data_ptr()


def test_kv_scales_belong_to_a_float8_pool() -> None:
    """A (K, V) scale pair a layer: (1, 1) for a pool of the model's dtype, given for a float8 one."""
    assert make_mem().kv_scales == [(1.0, 1.0)] * 3
    fp8 = MemoryManager(8, torch.float8_e4m3fn, 2, 4, 2, kv_scales=[(0.5, 0.25), (1.0, 2.0)])
    assert fp8.kv_scales == [(0.5, 0.25), (1.0, 2.0)] and fp8.kv_buffer[0].dtype == torch.float8_e4m3fn
    for dtype, scales in [(torch.float16, [(0.5, 0.25)] * 2), (torch.float8_e4m3fn, [(0.5, 0.25)])]:
        with pytest.raises(ValueError, match="kv_scales"):
            MemoryManager(8, dtype, 2, 4, 2, kv_scales=scales)


def test_alloc_gives_distinct_int32_slots_with_ref_one() -> None:
    mem = make_mem(16)
    a = mem.alloc(5)
    b = mem.alloc(3)
    assert a.dtype == torch.int32 and a.device.type == "cpu"
    assert a.tolist() == [0, 1, 2, 3, 4]  # a fresh pool hands out a contiguous run
    assert set(a.tolist()).isdisjoint(b.tolist())
    assert mem.can_use_mem_size == 8
    counts = mem.ref_counts
    assert counts[torch.cat([a, b]).long()].eq(1).all() and int(counts.sum()) == 8
    assert mem.alloc(0).numel() == 0


def test_free_returns_slots_at_once() -> None:
    mem = make_mem(8)
    a = mem.alloc(8)
    assert mem.can_use_mem_size == 0
    mem.free(a[2:5])
    assert mem.can_use_mem_size == 3
    again = mem.alloc(3)
    assert sorted(again.tolist()) == [2, 3, 4]


def test_kv_cache_full_leaves_state_unchanged() -> None:
    mem = make_mem(8)
    mem.alloc(6)
    before = snapshot(mem)
    with pytest.raises(KVCacheFullError, match="asked for 3 token slots, 2 of 8 are free"):
        mem.alloc(3)
    assert snapshot(mem) == before
    assert isinstance(KVCacheFullError("x"), RuntimeError)
    assert mem.alloc(2).numel() == 2


def test_double_free_raises_and_changes_nothing() -> None:
    mem = make_mem(8)
    a = mem.alloc(4)
    mem.free(a[:1])
    before = snapshot(mem)
    with pytest.raises(ValueError, match="double free"):
        mem.free(a[:2])  # slot 0 already free, slot 1 not: neither may change
    assert snapshot(mem) == before
    with pytest.raises(ValueError, match="double free"):
        mem.free(torch.tensor([1, 1]))  # referenced once, freed twice
    assert snapshot(mem) == before


def test_incref_shares_slots_until_last_free() -> None:
    mem = make_mem(8)
    a = mem.alloc(3)
    mem.incref(a[:2])
    mem.incref(torch.tensor([0]))
    assert mem.ref_counts[:3].tolist() == [3, 2, 1]
    mem.free(a)
    assert mem.ref_counts[:3].tolist() == [2, 1, 0] and mem.can_use_mem_size == 6
    mem.free(torch.tensor([0, 0, 1]))  # one reference per occurrence
    assert mem.can_use_mem_size == 8 and int(mem.ref_counts.sum()) == 0


def test_incref_of_free_slot_and_out_of_range_raise() -> None:
    mem = make_mem(8)
    a = mem.alloc(2)
    before = snapshot(mem)
    with pytest.raises(ValueError, match="incref of free"):
        mem.incref(torch.tensor([a[0].item(), 5]))
    with pytest.raises(ValueError, match="out of range"):
        mem.free(torch.tensor([8]))
    with pytest.raises(ValueError, match="out of range"):
        mem.incref(torch.tensor([-1]))
    with pytest.raises(ValueError, match="non-negative"):
        mem.alloc(-1)
    with pytest.raises(TypeError):
        mem.free(torch.tensor([0.0]))
    assert snapshot(mem) == before


def test_free_all_resets_the_pool() -> None:
    mem = make_mem(8)
    a = mem.alloc(5)
    mem.incref(a)
    mem.free_all()
    assert mem.can_use_mem_size == 8 and int(mem.ref_counts.sum()) == 0
    assert mem.alloc(8).tolist() == list(range(8))


def test_bookkeeping_survives_inference_mode() -> None:
    """The model's forward runs under torch.inference_mode(); bookkeeping touched there must stay
    updatable outside it (an inference tensor cannot be modified in place outside the mode)."""
    mem = make_mem(8)
    reqs = ReqManager(max_request_num=2, max_sequence_length=8, mem_manager=mem)
    with torch.inference_mode():
        r = reqs.alloc_req()
        reqs.alloc_batch([r], [3])
    reqs.truncate(r, 1)
    with torch.inference_mode():
        reqs.free_req(r)
        mem.free_all()
    a = mem.alloc(2)
    mem.incref(a)
    mem.free(a)
    mem.free(a)
    r = reqs.alloc_req()
    reqs.append_tokens(r, 2)
    assert reqs.seq_len(r) == 2 and mem.can_use_mem_size == 6


# ---------------------------------------------------------------------------------------------
# ReqManager


def test_req_append_truncate_free() -> None:
    mem = make_mem(16)
    reqs = ReqManager(max_request_num=2, max_sequence_length=8, mem_manager=mem)
    assert reqs.req_to_token.shape == (2, 8) and reqs.req_to_token.dtype == torch.int32
    r = reqs.alloc_req()
    s1 = reqs.append_tokens(r, 3)
    s2 = reqs.append_tokens(r, 2)
    assert reqs.seq_len(r) == 5
    assert reqs.req_to_token[r, :5].tolist() == s1.tolist() + s2.tolist()
    reqs.truncate(r, 2)
    assert reqs.seq_len(r) == 2 and mem.can_use_mem_size == 14
    reqs.free_req(r)
    assert mem.can_use_mem_size == 16
    with pytest.raises(ValueError, match="not allocated"):
        reqs.seq_len(r)


def test_req_rows_run_out() -> None:
    reqs = ReqManager(max_request_num=2, max_sequence_length=4, mem_manager=make_mem())
    a, b = reqs.alloc_req(), reqs.alloc_req()
    assert {a, b} == {0, 1} and reqs.can_use_req_size == 0
    with pytest.raises(TooManyRequestsError):
        reqs.alloc_req()
    reqs.free_req(a)
    assert reqs.alloc_req() == a


def test_append_errors_change_nothing() -> None:
    mem = make_mem(6)
    reqs = ReqManager(max_request_num=2, max_sequence_length=5, mem_manager=mem)
    r = reqs.alloc_req()
    reqs.append_tokens(r, 4)
    before = (snapshot(mem), reqs.req_to_token.clone(), reqs.seq_len(r))
    with pytest.raises(ValueError, match="max_sequence_length=5"):
        reqs.append_tokens(r, 2)
    other = reqs.alloc_req()
    with pytest.raises(KVCacheFullError):
        reqs.append_tokens(other, 3)
    with pytest.raises(ValueError, match="truncate"):
        reqs.truncate(r, 5)
    with pytest.raises(ValueError, match="out of range"):
        reqs.append_tokens(7, 1)
    assert (snapshot(mem), reqs.seq_len(r)) == (before[0], before[2])
    assert torch.equal(reqs.req_to_token, before[1]) and reqs.seq_len(other) == 0


def test_alloc_batch_writes_rows_in_batch_order() -> None:
    mem = make_mem(12)
    reqs = ReqManager(max_request_num=4, max_sequence_length=10, mem_manager=mem)
    r0, r1, r2 = reqs.alloc_req(), reqs.alloc_req(), reqs.alloc_req()
    reqs.append_tokens(r1, 2)
    slots = reqs.alloc_batch([r2, r1, r0], [3, 0, 2])
    assert slots.numel() == 5 and mem.can_use_mem_size == 12 - 7
    assert reqs.req_to_token[r2, :3].tolist() == slots[:3].tolist()
    assert reqs.req_to_token[r0, :2].tolist() == slots[3:].tolist()
    assert [reqs.seq_len(r) for r in (r0, r1, r2)] == [2, 2, 3]
    before = snapshot(mem)
    with pytest.raises(KVCacheFullError):
        reqs.alloc_batch([r0, r1], [3, 3])  # 6 > 5 free, each row within max length
    with pytest.raises(ValueError, match="twice"):
        reqs.alloc_batch([r0, r0], [1, 1])
    with pytest.raises(ValueError, match="differ in length"):
        reqs.alloc_batch([r0], [1, 1])
    assert snapshot(mem) == before and [reqs.seq_len(r) for r in (r0, r1, r2)] == [2, 2, 3]


def test_shared_prefix_survives_one_owner_finishing() -> None:
    """A prefix cache increfs a request's slots; freeing the request must leave them in use."""
    mem = make_mem(8)
    reqs = ReqManager(max_request_num=2, max_sequence_length=8, mem_manager=mem)
    r = reqs.alloc_req()
    prefix = reqs.append_tokens(r, 3)
    mem.incref(prefix)
    reqs.free_req(r)
    assert mem.can_use_mem_size == 5 and mem.ref_counts[prefix.long()].eq(1).all()
    mem.free(prefix)
    assert mem.can_use_mem_size == 8


def test_row_bookkeeping_never_reads_the_device_table() -> None:
    """On a GPU a read of ``req_to_token`` waits for every step queued before it. A "meta" pool
    stands in for one whose table cannot be read at all: reading a row's slots, sharing them as
    a prefix, truncating and freeing rows all work from the host copy."""
    mem = MemoryManager(16, torch.float32, 1, 1, 1, device="meta")
    reqs = ReqManager(max_request_num=2, max_sequence_length=8, mem_manager=mem)
    r = reqs.alloc_req()
    assert reqs.alloc_batch([r], [5]).device.type == "meta"
    own = reqs.slots(r, 0, 5)
    assert own.device.type == "cpu" and own.tolist() == list(range(5))
    other = reqs.alloc_req()
    reqs.share_prefix(other, own[:3])
    reqs.append_tokens(other, 2)
    assert reqs.slots(other, 0, 5).tolist() == [0, 1, 2, 5, 6]
    reqs.truncate(other, 4)
    reqs.free_req(r)
    assert mem.can_use_mem_size == 16 - 4 and mem.ref_counts[:7].tolist() == [1, 1, 1, 0, 0, 1, 0]
    reqs.free_req(other)
    assert mem.can_use_mem_size == 16


# ---------------------------------------------------------------------------------------------
# Property-based: random operation sequences against a plain Python model

POOL = 24
ROWS = 4
MAX_SEQ = 10


class KVMachine(RuleBasedStateMachine):
    """Model: ref count per slot; references the test holds itself; each request's slot list."""

    def __init__(self) -> None:
        super().__init__()
        self.mem = make_mem(POOL)
        self.reqs = ReqManager(max_request_num=ROWS, max_sequence_length=MAX_SEQ, mem_manager=self.mem)
        self.refs = [0] * POOL
        self.held: list[list[int]] = []  # each entry: one reference on each of its slots
        self.rows: dict[int, list[int]] = {}

    # -- helpers --------------------------------------------------------------------------------
    def _take(self, slots: torch.Tensor) -> list[int]:
        got = slots.tolist()
        assert slots.dtype == torch.int32
        assert len(set(got)) == len(got), "slot handed out twice in one allocation"
        for s in got:
            assert self.refs[s] == 0, f"slot {s} handed out while in use"
            self.refs[s] = 1
        return got

    def _free_slots(self) -> list[int]:
        return [s for s in range(POOL) if self.refs[s] == 0]

    def _expect_unchanged(self, exc: type[Exception], fn, *args) -> None:
        before = (snapshot(self.mem), self.reqs.req_to_token.clone())
        with pytest.raises(exc):
            fn(*args)
        assert snapshot(self.mem) == before[0]
        assert torch.equal(self.reqs.req_to_token, before[1])

    # -- pool rules -------------------------------------------------------------------------------
    @rule(n=st.integers(0, POOL + 2))
    def alloc(self, n: int) -> None:
        if n > self.mem.can_use_mem_size:
            self._expect_unchanged(KVCacheFullError, self.mem.alloc, n)
        else:
            self.held.append(self._take(self.mem.alloc(n)))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_held(self, data: st.DataObject) -> None:
        slots = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.mem.free(torch.tensor(slots, dtype=torch.int32))
        for s in slots:
            self.refs[s] -= 1

    @precondition(lambda self: any(self.held))
    @rule(data=st.data())
    def incref_some(self, data: st.DataObject) -> None:
        in_use = sorted({s for h in self.held for s in h} | {s for r in self.rows.values() for s in r})
        slots = data.draw(st.lists(st.sampled_from(in_use), min_size=1, max_size=6))
        self.mem.incref(torch.tensor(slots))
        for s in slots:
            self.refs[s] += 1
        self.held.append(slots)

    @precondition(lambda self: any(r == 0 for r in self.refs))
    @rule(data=st.data())
    def misuse_free_slot(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(self._free_slots()))
        self._expect_unchanged(ValueError, self.mem.free, torch.tensor([slot]))
        self._expect_unchanged(ValueError, self.mem.incref, torch.tensor([slot]))

    # -- request rules ----------------------------------------------------------------------------
    @rule()
    def alloc_req(self) -> None:
        if len(self.rows) == ROWS:
            self._expect_unchanged(TooManyRequestsError, self.reqs.alloc_req)
            return
        r = self.reqs.alloc_req()
        assert r not in self.rows
        self.rows[r] = []

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), n=st.integers(0, 6))
    def append(self, data: st.DataObject, n: int) -> None:
        r = data.draw(st.sampled_from(sorted(self.rows)))
        if len(self.rows[r]) + n > MAX_SEQ:
            self._expect_unchanged(ValueError, self.reqs.append_tokens, r, n)
        elif n > self.mem.can_use_mem_size:
            self._expect_unchanged(KVCacheFullError, self.reqs.append_tokens, r, n)
        else:
            self.rows[r] += self._take(self.reqs.append_tokens(r, n))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def batch(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, unique=True))
        ns = data.draw(st.lists(st.integers(0, 4), min_size=len(rows), max_size=len(rows)))
        if any(len(self.rows[r]) + n > MAX_SEQ for r, n in zip(rows, ns)):
            self._expect_unchanged(ValueError, self.reqs.alloc_batch, rows, ns)
        elif sum(ns) > self.mem.can_use_mem_size:
            self._expect_unchanged(KVCacheFullError, self.reqs.alloc_batch, rows, ns)
        else:
            got = self._take(self.reqs.alloc_batch(rows, ns))
            for r, n in zip(rows, ns):
                self.rows[r] += got[:n]
                got = got[n:]

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, unique=True))
        new_lens = [data.draw(st.integers(0, len(self.rows[r]))) for r in rows]
        if len(rows) == 1:
            self.reqs.truncate(rows[0], new_lens[0])
        else:
            self.reqs.truncate_batch(rows, new_lens)
        for r, new_len in zip(rows, new_lens):
            for s in self.rows[r][new_len:]:
                self.refs[s] -= 1
            self.rows[r] = self.rows[r][:new_len]

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def truncate_past_the_end(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, unique=True))
        new_lens = [data.draw(st.integers(0, len(self.rows[r]))) for r in rows]
        new_lens[-1] = len(self.rows[rows[-1]]) + 1      # the last one cannot be cut: none is
        self._expect_unchanged(ValueError, self.reqs.truncate_batch, rows, new_lens)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def free_req(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(sorted(self.rows)))
        self.reqs.free_req(r)
        for s in self.rows.pop(r):
            self.refs[s] -= 1

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def counts_add_up(self) -> None:
        used = sum(1 for r in self.refs if r > 0)
        assert self.mem.can_use_mem_size + used == POOL

    @invariant()
    def ref_counts_match(self) -> None:
        assert self.mem.ref_counts.tolist() == self.refs

    @invariant()
    def table_matches(self) -> None:
        assert self.reqs.can_use_req_size == ROWS - len(self.rows)
        for r, slots in self.rows.items():
            assert self.reqs.seq_len(r) == len(slots)
            assert self.reqs.req_to_token[r, : len(slots)].tolist() == slots


KVMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMachine = KVMachine.TestCase


def test_alloc_batch_rejects_a_stale_view_of_the_cache() -> None:
    mem = make_mem(16)
    reqs = ReqManager(4, 8, mem)
    a, b = reqs.alloc_req(), reqs.alloc_req()
    reqs.alloc_batch([a, b], [3, 2], expected_lens=[0, 0])
    before = snapshot(mem)
    with pytest.raises(ValueError, match="holds 2 cached tokens, the batch says 3"):
        reqs.alloc_batch([a, b], [1, 1], expected_lens=[3, 3])
    assert snapshot(mem) == before and reqs.seq_len(a) == 3 and reqs.seq_len(b) == 2
