"""The prefix cache's tree: a radix tree over token ids, kept by the engine core.

Each node holds a run of tokens (its ``key``); the path from the root to a node spells a prefix
whose KV the workers hold, one slot per token. The engine core owns the tree (which prefixes are
cached, who uses them, what goes first); the workers own the slots. So the tree does no tensor
work: every change a worker must mirror comes out as a small op (``SplitNode``, ``CacheTokens``,
``EvictNode``, in ``llmserve.worker.protocol``), queued in ``ops`` and sent to every rank with
the next step, which applies them in order (``llmserve.worker.prefix_slots``).

Granularity is one token: a match may end mid-way through a node's key, which then splits in two
(the new node is the upper part, so a node's id always names the same deepest token).

Two kinds of hold keep a node from eviction, and each holds the node's whole path up to the root:
a lock (``lock``: a running request whose cached prefix goes through it) and a pin (``pin``: a
session keeping its conversation; soft, released oldest first before the scheduler preempts
anything: prefix_cache.py). Eviction takes the least recently used leaves that neither holds.

A key is a sequence of ints: token ids, except that an image placeholder is written as a negative
hash of that image's pixels, and a LoRA request's first token as a pair (adapter, token)
(``PrefixCacheManager.key``), so different images or adapters never share KV.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmserve.worker.protocol import CacheOp, CacheTokens, EvictNode, SplitNode


@dataclass(eq=False)   # a node is an entity: equal only to itself, and hashable
class Node:
    id: int
    key: list[int]
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)   # first token of the child's key -> child
    lock_count: int = 0          # running requests whose cached prefix goes through this node
    pin_count: int = 0           # sessions whose pinned conversation goes through this node
    last_access: int = 0         # logical clock: the least recently used leaves are evicted first

    @property
    def held(self) -> bool:
        return self.lock_count > 0 or self.pin_count > 0


class RadixCache:
    def __init__(self) -> None:
        self.root = Node(0, [], None)
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.ops: list[CacheOp] = []       # for the workers, in order (``take_ops``)
        self.num_tokens = 0                # slots the tree holds
        self.num_locked_tokens = 0         # of those, in nodes some running request locks
        self.num_pinned_tokens = 0         # of those, in nodes only sessions pin
        self.num_evicted_tokens = 0        # since start

    # -- queries ---------------------------------------------------------------------------
    def match(self, key: Sequence[int]) -> tuple[Node, int]:
        """The longest cached prefix of ``key``: its deepest node and its length. An edge the
        match ends inside is split there, so the prefix is exactly a root-to-node path. The
        path counts as used now (LRU)."""
        node, n = self._walk(key, split=True)
        self._touch(node)
        return node, n

    def prefix_length(self, key: Sequence[int]) -> int:
        """``match``'s length, changing nothing (to rank waiting requests)."""
        return self._walk(key, split=False)[1]

    def _walk(self, key: Sequence[int], split: bool) -> tuple[Node, int]:
        """The deepest node whose whole path ``key`` starts with, and the length of the match,
        which may go on part-way into one of its children's key: that child is split there
        (and becomes the node) with ``split``."""
        node, n = self.root, 0
        while n < len(key):
            child = node.children.get(key[n])
            if child is None:
                break
            k = _common_length(child.key, key, n)
            if k < len(child.key):
                if not split:
                    return node, n + k
                child = self._split(child, k)
            node, n = child, n + k
        return node, n

    def path(self, node: Node) -> list[Node]:
        """The nodes from the root's child down to ``node`` (the root itself has no tokens)."""
        nodes = []
        while node is not self.root:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    @staticmethod
    def depth(node: Node) -> int:
        """Tokens on the path to ``node``."""
        n = 0
        while node.parent is not None:
            n += len(node.key)
            node = node.parent
        return n

    @property
    def num_evictable_tokens(self) -> int:
        """Slots held by nodes that nothing locks or pins."""
        return self.num_tokens - self.num_locked_tokens - self.num_pinned_tokens

    # -- changes ---------------------------------------------------------------------------
    def insert(self, key: Sequence[int], req_id: int) -> tuple[Node, int]:
        """Cache a request's first ``len(key)`` tokens, whose KV its row holds at positions
        [0, len(key)). What the tree has already stays as it is; the rest becomes one new leaf
        that takes the request's slots of those positions (``CacheTokens``). Returns the deepest
        node of ``key`` and how many tokens the new leaf took (0: none was needed).

        The request's row positions past what the tree already held must hold its own slots
        (not the tree's): true of a request whose tree-held positions are on a path it locks."""
        node, n = self.match(key)
        if n == len(key):
            return node, 0
        leaf = Node(next(self._ids), list(key[n:]), node, last_access=next(self._clock))
        node.children[leaf.key[0]] = leaf
        self.num_tokens += len(leaf.key)
        self.ops.append(CacheTokens(leaf.id, req_id, n, len(key)))
        return leaf, len(key) - n

    def lock(self, node: Node) -> None:
        self._hold(node, lock=1)

    def unlock(self, node: Node) -> None:
        self._hold(node, lock=-1)

    def pin(self, node: Node) -> None:
        self._hold(node, pin=1)

    def unpin(self, node: Node) -> None:
        self._hold(node, pin=-1)

    def discard(self, node: Node) -> int:
        """Unpin ``node`` (a session's conversation) and remove what of its path nothing else
        holds or shares: from the leaf up to the first node with another child or a hold.
        Returns the slots freed."""
        self.unpin(node)
        freed = 0
        while node is not self.root and not node.children and not node.held:
            parent = node.parent
            freed += self._remove(node)
            node = parent
        return freed

    def evict(self, num_tokens: int) -> int:
        """Evict least recently used leaves that nothing holds until ``num_tokens`` slots are
        freed or none is left; returns the slots freed."""
        leaves = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and not n.held]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < num_tokens:
            _, _, node = heapq.heappop(leaves)
            freed += self._remove(node)
            parent = node.parent
            if parent is not self.root and not parent.children and not parent.held:
                heapq.heappush(leaves, (parent.last_access, parent.id, parent))
        return freed

    def take_ops(self) -> list[CacheOp]:
        ops, self.ops = self.ops, []
        return ops

    # -- internals -------------------------------------------------------------------------
    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node``'s key at ``at``: a new node takes the first ``at`` tokens and becomes its
        parent; ``node`` keeps the rest (and its id, children and holds)."""
        upper = Node(next(self._ids), node.key[:at], node.parent, lock_count=node.lock_count,
                     pin_count=node.pin_count, last_access=node.last_access)
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        self.ops.append(SplitNode(node.id, at, upper.id))
        return upper

    def _touch(self, node: Node) -> None:
        now = next(self._clock)
        while node is not None:
            node.last_access = now
            node = node.parent

    def _hold(self, node: Node, lock: int = 0, pin: int = 0) -> None:
        """Add a lock or a pin (or drop one: -1) to every node of ``node``'s path."""
        self._touch(node)
        while node is not self.root:
            self._count(node, -1)
            node.lock_count += lock
            node.pin_count += pin
            assert node.lock_count >= 0 and node.pin_count >= 0, node.id
            self._count(node, +1)
            node = node.parent

    def _count(self, node: Node, sign: int) -> None:
        """Add (+1) or take out (-1) the node's tokens from the held tallies."""
        if node.lock_count:
            self.num_locked_tokens += sign * len(node.key)
        elif node.pin_count:
            self.num_pinned_tokens += sign * len(node.key)

    def _remove(self, node: Node) -> int:
        assert not node.children and not node.held, node.id
        del node.parent.children[node.key[0]]
        self.num_tokens -= len(node.key)
        self.num_evicted_tokens += len(node.key)
        self.ops.append(EvictNode(node.id))
        return len(node.key)

    def _nodes(self) -> list[Node]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes


def _common_length(edge: list[int], key: Sequence[int], start: int) -> int:
    """How many leading tokens of ``edge`` equal ``key[start:]``'s."""
    n = min(len(edge), len(key) - start)
    if edge[:n] == list(key[start : start + n]):   # the common case: the whole edge matches
        return n
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i
