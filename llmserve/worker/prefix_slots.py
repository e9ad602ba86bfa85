"""A worker's mirror of the engine's prefix tree: each node's KV slots.

The engine core keeps the tree (``llmserve.engine.radix_cache``) and sends its changes with each
step as ops; every rank applies the same ops in the same order, so every rank's pool holds the
same slots. A node holds one reference to each of its slots (``MemoryManager`` counts them), so
a slot lives while the tree or any request's row still uses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from llmserve.common.mem_manager import ReqManager
from llmserve.worker.protocol import CacheOp, CacheTokens, EvictNode, SplitNode


class PrefixSlots:
    def __init__(self, req_manager: ReqManager) -> None:
        self.req_manager = req_manager
        self.mem_manager = req_manager.mem_manager
        self.node_slots: dict[int, torch.Tensor] = {}    # node id -> its slots (CPU), in key order

    def apply(self, ops: Iterable[CacheOp], req_rows: Mapping[int, int]) -> None:
        """Mirror the tree's changes; ``req_rows``: each request's row of the req->token table."""
        for op in ops:
            if isinstance(op, CacheTokens):
                # Read from, and kept on, the host, where the pool counts references: taking,
                # sharing and evicting a node's slots never waits for the device.
                slots = self.req_manager.slots(req_rows[op.req_id], op.start, op.end)
                self.mem_manager.incref(slots)
                self.node_slots[op.node_id] = slots
            elif isinstance(op, SplitNode):
                slots = self.node_slots[op.node_id]
                self.node_slots[op.new_node_id] = slots[: op.at]
                self.node_slots[op.node_id] = slots[op.at :]
            elif isinstance(op, EvictNode):
                self.mem_manager.free(self.node_slots.pop(op.node_id))
            else:
                raise TypeError(f"unknown prefix-cache op {op!r}")

    def share(self, row: int, node_ids: list[int]) -> None:
        """Start the request in ``row`` with the slots of the path ``node_ids`` (root first). A
        row that has them already (its step runs again after a failed forward) is left as is."""
        slots = torch.cat([self.node_slots[i] for i in node_ids])
        if self.req_manager.seq_len(row) == slots.numel():
            return
        self.req_manager.share_prefix(row, slots)

    @property
    def num_slots(self) -> int:
        return sum(s.numel() for s in self.node_slots.values())
