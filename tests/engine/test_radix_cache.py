"""The prefix cache's tree (engine/radix_cache.py) with a worker's mirror of it
(worker/prefix_slots.py) over a real KV pool, against a dict-of-prefixes model.

The model maps every cached prefix (a tuple of tokens) to the KV slot of its last token. Requests
run as the engine and a worker run them: match (and lock) a prefix, start a row from its slots,
allocate the rest, put their tokens in the tree when they finish. After every step the tree must
hold exactly the model's prefixes with the model's slots, and every slot's reference count must
be the number of tree nodes and request rows that hold it: no slot is freed while referenced,
and none is kept once nothing references it.
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from llmserve.common.mem_manager import MemoryManager, ReqManager
from llmserve.engine.radix_cache import Node, RadixCache
from llmserve.worker.prefix_slots import PrefixSlots
from llmserve.worker.protocol import CacheTokens, EvictNode, SplitNode

POOL = 256
ROWS = 8
sequences = st.lists(st.integers(0, 2), min_size=1, max_size=10)


class Running:
    """A request that runs: its tokens, its row, the node it locks."""

    def __init__(self, req_id: int, tokens: list[int], row: int, node: Node):
        self.req_id, self.tokens, self.row, self.node = req_id, tokens, row, node


class PrefixCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.cache = RadixCache()
        self.mem = MemoryManager(POOL, torch.float32, 1, 1, 1)
        self.req_manager = ReqManager(ROWS, 32, self.mem)
        self.slots = PrefixSlots(self.req_manager)
        self.model: dict[tuple[int, ...], int] = {}   # cached prefix -> the slot of its last token
        self.running: dict[int, Running] = {}
        self.rows: dict[int, int] = {}                # req_id -> row, as the worker keeps them
        self.next_id = 0

    def sync(self) -> None:
        """The worker applies the tree's ops, as at the start of a step."""
        self.slots.apply(self.cache.take_ops(), self.rows)

    @precondition(lambda self: len(self.running) < ROWS)
    @rule(target=requests, tokens=sequences)
    def start(self, tokens):
        # As the scheduler: the last token stays uncached.
        node, n = self.cache.match(tokens[:-1])
        expected = max(k for k in range(len(tokens)) if k == 0 or tuple(tokens[:k]) in self.model)
        assert n == expected
        self.cache.lock(node)
        req_id, self.next_id = self.next_id, self.next_id + 1
        row = self.req_manager.alloc_req()
        self.rows[req_id] = row
        self.sync()
        if n:
            self.slots.share(row, [x.id for x in self.cache.path(node)])
            shared = self.req_manager.slots(row, 0, n).tolist()
            assert shared == [self.model[tuple(tokens[: i + 1])] for i in range(n)]
        self.req_manager.append_tokens(row, len(tokens) - n)
        self.running[req_id] = Running(req_id, tokens, row, node)
        return req_id

    @rule(req_id=consumes(requests), keep=st.booleans(), cut=st.integers(0, 10))
    def finish(self, req_id, keep, cut):
        """The request ends: with ``keep``, its first tokens (all but ``cut`` of them) go in the
        tree, then its row is freed and its lock dropped."""
        req = self.running.pop(req_id)
        if keep:
            n = max(0, len(req.tokens) - cut)
            node, added = self.cache.insert(req.tokens[:n], req_id)
            assert self.cache.depth(node) == n
            row_slots = self.req_manager.slots(req.row, 0, len(req.tokens)).tolist()
            for i in range(n):
                self.model.setdefault(tuple(req.tokens[: i + 1]), row_slots[i])
        self.sync()                                    # before the row goes
        self.cache.unlock(req.node)
        self.req_manager.free_req(self.rows.pop(req_id))

    @rule(num_tokens=st.integers(1, 40))
    def evict(self, num_tokens):
        evictable = self.cache.num_evictable_tokens
        freed = self.cache.evict(num_tokens)
        assert freed >= min(num_tokens, evictable) and freed <= evictable
        ops = self.cache.take_ops()
        assert all(isinstance(op, EvictNode) for op in ops)
        self.slots.apply(ops, self.rows)
        kept = self.tree_prefixes()
        assert set(kept) <= set(self.model)
        for req in self.running.values():     # a locked path stays
            prefix = self.cache.depth(req.node)
            assert all(tuple(req.tokens[: i + 1]) in kept for i in range(prefix))
        self.model = {k: v for k, v in self.model.items() if k in kept}

    @rule(req_id=requests, tokens=sequences)
    def pin_and_unpin(self, req_id, tokens):
        """A pin holds a path against eviction until it is dropped."""
        node, _ = self.cache.match(tokens)
        self.cache.pin(node)
        self.cache.evict(POOL)
        self.slots.apply(self.cache.take_ops(), self.rows)
        depth = self.cache.depth(node)
        assert all(tuple(tokens[: i + 1]) in self.tree_prefixes() for i in range(depth))
        self.model = {k: v for k, v in self.model.items() if k in self.tree_prefixes()}
        self.cache.unpin(node)

    @rule(tokens=sequences)
    def pin_and_release(self, tokens):
        """A session ends: its pin goes, and so does what of its path nothing else holds or
        shares; the rest of the tree stays as it was."""
        node, _ = self.cache.match(tokens)
        self.sync()
        before = self.tree_prefixes()
        path = self.cache.path(node)
        if node is self.cache.root:
            return
        self.cache.pin(node)
        freed = self.cache.release(node)
        self.sync()
        kept = self.tree_prefixes()
        assert set(kept) <= set(before) and len(before) - len(kept) == freed
        gone = [x for x in path if x.parent is not None and x.key[0] not in x.parent.children]
        assert sum(len(x.key) for x in gone) == freed
        assert all(not x.held for x in gone)
        self.model = {k: v for k, v in self.model.items() if k in kept}

    def tree_prefixes(self) -> dict[tuple[int, ...], int]:
        """Every prefix the tree holds, with the worker's slot of its last token."""
        out, stack = {}, [(self.cache.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                slots = self.slots.node_slots[child.id].tolist()
                assert len(slots) == len(child.key) > 0
                for i, slot in enumerate(slots):
                    out[prefix + tuple(child.key[: i + 1])] = slot
                stack.append((child, prefix + tuple(child.key)))
        return out

    @invariant()
    def tree_is_the_model(self):
        self.sync()
        assert self.tree_prefixes() == self.model
        assert self.cache.num_tokens == len(self.model) == self.slots.num_slots
        locked = {x for r in self.running.values() for x in self.cache.path(r.node)}
        assert self.cache.num_locked_tokens == sum(len(x.key) for x in locked)

    @invariant()
    def reference_counts_are_the_holders(self):
        holders = Counter(self.model.values())
        for req in self.running.values():
            holders.update(self.req_manager.slots(req.row, 0, len(req.tokens)).tolist())
        counts = self.mem.ref_counts
        assert {i: int(c) for i, c in enumerate(counts.tolist()) if c} == dict(holders)

    def teardown(self):
        # Everything ends; a full eviction then frees every slot.
        for req_id in list(self.running):
            self.finish(req_id, keep=True, cut=0)
        self.cache.evict(POOL)
        self.sync()
        assert self.cache.num_tokens == 0 and not self.slots.node_slots
        assert self.mem.can_use_mem_size == POOL and int(self.mem.ref_counts.sum()) == 0


PrefixCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_prefix_cache_against_a_dict_of_prefixes = PrefixCacheMachine.TestCase


def test_a_match_ending_inside_an_edge_splits_it():
    cache = RadixCache()
    leaf, added = cache.insert([1, 2, 3, 4], req_id=7)
    assert added == 4 and cache.take_ops() == [CacheTokens(leaf.id, 7, 0, 4)]
    node, n = cache.match([1, 2, 9])
    assert n == 2 and node.key == [1, 2] and leaf.key == [3, 4] and leaf.parent is node
    assert cache.take_ops() == [SplitNode(leaf.id, 2, node.id)]


def test_eviction_takes_least_recently_used_leaves_first():
    cache = RadixCache()
    a, _ = cache.insert([1, 1], req_id=0)
    b, _ = cache.insert([2, 2], req_id=1)
    cache.match([1, 1])                        # a used again: b is the older
    assert cache.evict(1) == 2 and cache.prefix_length([2, 2]) == 0 and cache.prefix_length([1, 1]) == 2
    cache.lock(a)
    assert cache.evict(10) == 0                # locked: kept


def test_release_removes_what_only_the_released_path_held():
    cache = RadixCache()
    a, _ = cache.insert([1, 2, 3], req_id=0)
    b, _ = cache.insert([1, 2, 4, 5], req_id=1)     # [1, 2] is now a node both share
    cache.pin(b)
    assert cache.release(b) == 2                     # [4, 5] goes; the shared [1, 2] stays
    assert cache.prefix_length([1, 2, 4, 5]) == 2 and cache.prefix_length([1, 2, 3]) == 3
    cache.pin(a)
    cache.lock(a.parent)                             # a running request uses [1, 2]
    assert cache.release(a) == 1 and cache.prefix_length([1, 2, 3]) == 2
    cache.unlock(a.parent)
    assert cache.num_pinned_tokens == 0 and cache.num_tokens == 2


def test_the_workers_mirror_never_reads_the_device():
    """Every op of a step is applied from the slots' host copy: a "meta" pool, whose table cannot
    be read (a GPU's read would wait for the steps queued before), takes, splits, shares and
    evicts nodes all the same."""
    mem = MemoryManager(16, torch.float32, 1, 1, 1, device="meta")
    req_manager = ReqManager(2, 8, mem)
    slots = PrefixSlots(req_manager)
    cache = RadixCache()
    row = req_manager.alloc_req()
    req_manager.append_tokens(row, 4)
    leaf, _ = cache.insert([1, 2, 3, 4], req_id=7)
    node, _ = cache.match([1, 2, 9])
    slots.apply(cache.take_ops(), {7: row})
    assert slots.node_slots[node.id].tolist() == [0, 1] and slots.node_slots[leaf.id].tolist() == [2, 3]
    other = req_manager.alloc_req()
    slots.share(other, [node.id])
    req_manager.free_req(row)
    cache.evict(16)
    slots.apply(cache.take_ops(), {})
    assert not slots.node_slots and mem.ref_counts[:4].tolist() == [1, 1, 0, 0]
