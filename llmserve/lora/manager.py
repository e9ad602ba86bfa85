"""The engine core's view of the LoRA adapters: which are known (name -> local directory), which
sit in the workers' device pool (``max_loras`` slots), and which slot each running request uses.

An adapter is loaded into a slot when a request that names it is admitted and it is not resident:
a free slot, else the least recently used slot that no running request holds (its adapter is
evicted). When every slot is held by running requests, the request waits (the scheduler admits
it once one frees). Loads go to every rank with the next step (``take_loads``), before its
forward, so a step never runs an adapter that is not in place.

Imports no torch: the engine core stays light.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadAdapter:
    """Put adapter ``name`` (directory ``path``) in pool slot ``slot`` (every rank, before the step)."""
    slot: int
    name: str
    path: str


class LoraManager:
    def __init__(self, adapters: dict[str, str], max_loras: int) -> None:
        self.max_loras = max_loras
        self.paths: dict[str, str] = {}
        # name -> an id unique to this registration: the prefix cache keys by it, so an adapter
        # unloaded and loaded again under the same name (other weights) never meets its old KV.
        self.ids: dict[str, int] = {}
        self._next_id = itertools.count(1)
        for name, path in adapters.items():
            self.register(name, path)
        self._slots: OrderedDict[str, int] = OrderedDict()   # resident adapters, least recently used first
        self._holders: dict[int, int] = {}                   # slot -> running requests using it
        self._loads: list[LoadAdapter] = []
        # since start, for /metrics
        self.num_loads = 0

    # -- the known adapters ------------------------------------------------------------
    def register(self, name: str, path: str) -> None:
        self.paths[name] = path
        self.ids[name] = next(self._next_id)

    def unregister(self, name: str) -> bool:
        """Forget an adapter (False if a running request uses it: try again later). Its slot is free."""
        slot = self._slots.get(name)
        if slot is not None and self._holders.get(slot, 0):
            return False
        if slot is not None:
            del self._slots[name]
        self.paths.pop(name, None)
        self.ids.pop(name, None)
        return True

    @property
    def resident(self) -> list[str]:
        return list(self._slots)

    # -- requests' holds -----------------------------------------------------------------
    def acquire(self, name: str) -> int | None:
        """A slot holding adapter ``name`` for a request about to run (loaded with the next step if
        it was not resident); None if every slot is held by running requests."""
        slot = self._slots.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._slots[name] = slot
            self._loads.append(LoadAdapter(slot, name, self.paths[name]))
            self.num_loads += 1
        self._slots.move_to_end(name)
        self._holders[slot] = self._holders.get(slot, 0) + 1
        return slot

    def release(self, slot: int) -> None:
        """A request that held ``slot`` stopped running (finished, preempted or retired)."""
        self._holders[slot] -= 1

    def _free_slot(self) -> int | None:
        taken = set(self._slots.values())
        for slot in range(self.max_loras):
            if slot not in taken:
                return slot
        for name, slot in self._slots.items():     # least recently used first
            if not self._holders.get(slot, 0):
                del self._slots[name]
                return slot
        return None

    def take_loads(self) -> list[LoadAdapter]:
        loads, self._loads = self._loads, []
        return loads
