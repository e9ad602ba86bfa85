"""Token-level KV-cache memory ("TokenAttention") and the request -> token table.

The KV cache is one pool of ``size`` token slots per layer. A token of any request can live in
any slot, so there is no fragmentation and no padding: the attention kernels gather a request's
keys and values through ``ReqManager.req_to_token``.

Bookkeeping (reference counts, the free-slot stack, sequence lengths) lives in small CPU tensors:
it is touched by the scheduler between forward passes, where a device round trip per call would
cost more than the work itself, and vectorised tensor ops keep it O(batch) rather than a Python
loop per slot. Only the results (slot indices, the table) are put on the model's device.
"""

from __future__ import annotations

import math
import operator

import numpy as np
import torch

__all__ = [
    "kv_bytes_per_token",
    "KVCacheFullError",
    "TooManyRequestsError",
    "MemoryManager",
    "ReqManager",
]

_SLOT_DTYPE = torch.int32  # what kernels index the KV buffers with


class KVCacheFullError(RuntimeError):
    """More KV slots were asked for than are free. Nothing was allocated; the caller may retry
    later (after requests finish) or preempt a request."""


class TooManyRequestsError(KVCacheFullError):
    """Every row of the request table is taken. Nothing was allocated."""


def _is_int(value: object) -> bool:
    """True for Python / NumPy / 0-d tensor integers, False for bools and everything else."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _as_cpu_index(slots: torch.Tensor | list[int]) -> torch.Tensor:
    """``slots`` as a flat int64 CPU tensor (int64: what advanced indexing wants)."""
    t = torch.as_tensor(slots)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"slots must be an integer tensor, got dtype {t.dtype}")
    return t.detach().reshape(-1).to(device="cpu", dtype=torch.int64)


def kv_bytes_per_token(layer_num: int, head_num: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V over all layers (what sizes the pool from memory)."""
    return layer_num * 2 * head_num * head_dim * dtype.itemsize


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``, but on the CPU from calloc'd memory (numpy's zeros): the OS hands out
    zero pages there and maps each in only when it is first written, so a KV pool sized for the
    worst case (16384 tokens: 0.75 GB for SmolLM2) costs resident memory only as tokens fill it.
    ``torch.zeros`` writes every byte at once."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class MemoryManager:
    """A pool of ``size`` KV slots per layer with reference-counted allocation.

    Contract:
      * ``kv_buffer[l]``: ``[size, 2 * head_num, head_dim]`` of ``dtype`` on ``device``, K heads
        then V heads, so one scatter writes both (the fused qkv projection yields k and v side
        by side); ``key_buffer[l]`` / ``value_buffer[l]`` are its ``[size, head_num, head_dim]``
        halves (strided views). Slot ``i`` of every layer belongs to the same token.
      * ``alloc(n)`` hands out ``n`` distinct free slots (int32, on ``device``) with ref count 1,
        or raises :class:`KVCacheFullError` and changes nothing.
      * ``incref(slots)`` / ``free(slots)`` add / drop one reference per occurrence of a slot; a
        slot whose count drops to 0 is free again at once. Either raises ``ValueError`` without
        changing anything when asked to touch a free slot (or a slot out of range).
      * ``can_use_mem_size`` free slots + slots with ref count > 0 == ``size`` at all times.
      * ``kv_scales[l]``: layer l's (K, V) scales of a float8 pool (``--kv-cache-dtype fp8``: the
        stored value times its scale is the real one); (1.0, 1.0) for any other dtype. The kernels
        that store and read the pool take them (constants of a captured CUDA graph).
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device = "cpu",
        kv_scales: list[tuple[float, float]] | None = None,
    ) -> None:
        for name, value in (("size", size), ("head_num", head_num), ("head_dim", head_dim), ("layer_num", layer_num)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.size: int = size
        self.dtype: torch.dtype = dtype
        self.head_num: int = head_num
        self.head_dim: int = head_dim
        self.layer_num: int = layer_num
        self.device: torch.device = torch.device(device)
        if kv_scales is not None and (len(kv_scales) != layer_num or dtype.itemsize != 1):
            raise ValueError(f"kv_scales: one (K, V) pair a layer of a float8 pool, got {len(kv_scales)} for "
                             f"{layer_num} layers of {dtype}")
        self.kv_scales: list[tuple[float, float]] = list(kv_scales or [(1.0, 1.0)] * layer_num)
        # Zeroed rather than empty: a masked-out lane of a kernel may still multiply a stale
        # value by 0, and NaN garbage would survive that.
        self.kv_buffer: list[torch.Tensor] = [
            _lazy_zeros((size, 2 * head_num, head_dim), dtype, self.device) for _ in range(layer_num)
        ]
        self.key_buffer: list[torch.Tensor] = [kv[:, :head_num] for kv in self.kv_buffer]
        self.value_buffer: list[torch.Tensor] = [kv[:, head_num:] for kv in self.kv_buffer]
        self._ref_count = torch.zeros(size, dtype=torch.int32)
        # Free slots are _free_stack[:_num_free]; alloc pops from the top. Laid out descending so
        # that a fresh pool hands out 0, 1, 2, ... (contiguous runs are kinder to kernels).
        self._free_stack = torch.arange(size - 1, -1, -1, dtype=_SLOT_DTYPE)
        self._num_free: int = size

    @property
    def can_use_mem_size(self) -> int:
        """Number of free slots."""
        return self._num_free

    @property
    def ref_counts(self) -> torch.Tensor:
        """A copy of the per-slot reference counts (int32, CPU); 0 means free."""
        return self._ref_count.clone()

    def alloc(self, n: int) -> torch.Tensor:
        """``n`` free slots (int32 on ``device``), each now with ref count 1.

        Raises ``KVCacheFullError`` (state unchanged) when fewer than ``n`` slots are free.
        """
        # Not a blocking copy: that would wait for every step queued on the device, which the
        # overlapped loop keeps one step ahead. (From pageable memory the driver stages the
        # bytes before returning, so the temporary may go at once.)
        return self.alloc_host(n).to(self.device, non_blocking=True)

    def alloc_host(self, n: int) -> torch.Tensor:
        """``alloc``, the slots left on the host (int32, CPU), where the pool keeps its books."""
        if not _is_int(n) or n < 0:
            raise ValueError(f"number of slots to allocate must be a non-negative integer, got {n!r}")
        n = operator.index(n)
        if n > self._num_free:
            raise KVCacheFullError(
                f"KV cache full: asked for {n} token slots, {self._num_free} of {self.size} are free"
            )
        top = self._num_free
        # clone(): the stack region is overwritten by later frees, the caller's tensor must not be.
        slots = self._free_stack[top - n : top].flip(0).clone()
        self._num_free = top - n
        self._ref_count[slots.long()] = 1
        return slots

    def incref(self, slots: torch.Tensor) -> None:
        """Add one reference per occurrence of each slot (to share it, e.g. from a prefix cache).

        Raises ``ValueError`` (state unchanged) if any slot is free or out of range.
        """
        uniq, counts = self._unique_checked(slots)
        if uniq.numel() == 0:
            return
        current = self._ref_count[uniq]
        if bool((current == 0).any()):
            bad = uniq[current == 0][:8].tolist()
            raise ValueError(f"incref of free KV slot(s) {bad}: only slots in use can be shared")
        self._ref_count[uniq] = current + counts.to(torch.int32)

    def free(self, slots: torch.Tensor) -> None:
        """Drop one reference per occurrence of each slot; slots reaching 0 are free at once.

        Raises ``ValueError`` (state unchanged) if a slot is freed more times than it is referenced
        (a double free) or is out of range.
        """
        uniq, counts = self._unique_checked(slots)
        if uniq.numel() == 0:
            return
        current = self._ref_count[uniq]
        remaining = current - counts.to(torch.int32)
        if bool((remaining < 0).any()):
            bad = uniq[remaining < 0][:8].tolist()
            raise ValueError(f"double free of KV slot(s) {bad}: freed more often than referenced")
        self._ref_count[uniq] = remaining
        released = uniq[remaining == 0].to(_SLOT_DTYPE)
        self._push_free(released)

    def free_all(self) -> None:
        """Return every slot to the pool (e.g. after a failed batch or on reset)."""
        # In place: a tensor created under torch.inference_mode() (the model's forward runs there)
        # could never be updated in place outside it again.
        self._ref_count.zero_()
        self._free_stack.copy_(torch.arange(self.size - 1, -1, -1, dtype=_SLOT_DTYPE))
        self._num_free = self.size

    def _push_free(self, released: torch.Tensor) -> None:
        k = released.numel()
        # Flipped so that an alloc of the same size right after hands them back in this order.
        self._free_stack[self._num_free : self._num_free + k] = released.flip(0)
        self._num_free += k

    def _unique_checked(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct slots (int64, CPU) with their multiplicities; ``ValueError`` if out of range."""
        flat = _as_cpu_index(slots)
        if flat.numel() == 0:
            return flat, flat
        if bool(((flat < 0) | (flat >= self.size)).any()):
            bad = flat[(flat < 0) | (flat >= self.size)][:8].tolist()
            raise ValueError(f"KV slot(s) {bad} out of range [0, {self.size})")
        uniq, counts = torch.unique(flat, return_counts=True)
        return uniq, counts


class ReqManager:
    """req_to_token[req_idx, pos] -> KV slot of token ``pos`` of that request.

    Contract:
      * ``alloc_req()`` gives a free row (length 0) or raises :class:`TooManyRequestsError`.
      * ``append_tokens`` / ``alloc_batch`` take slots from ``mem_manager`` and write them into the
        rows after each row's current length; both are all-or-nothing.
      * ``truncate`` / ``free_req`` release the dropped positions' slots (one reference each).
      * Entries at positions >= ``seq_len(req_idx)`` are stale and must not be read.
      * The table has a host copy (the same tensor on a CPU pool) that every change writes too:
        reading a row's slots (``slots``, ``truncate``, ``free_req``) never waits for the device.
      * Misuse (a row not in use, a length past ``max_sequence_length``) is a ``ValueError`` that
        leaves the state unchanged.
    """

    def __init__(
        self,
        max_request_num: int,
        max_sequence_length: int,
        mem_manager: MemoryManager,
        device: str | torch.device | None = None,
    ) -> None:
        for name, value in (("max_request_num", max_request_num), ("max_sequence_length", max_sequence_length)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.max_request_num: int = max_request_num
        self.max_sequence_length: int = max_sequence_length
        self.mem_manager: MemoryManager = mem_manager
        self.device: torch.device = torch.device(device) if device is not None else mem_manager.device
        self.req_to_token: torch.Tensor = torch.zeros(
            (max_request_num, max_sequence_length), dtype=_SLOT_DTYPE, device=self.device
        )
        # The slots are on the host when they are handed out (the pool's books are there), so
        # keeping them there too costs a write; reading them back from the device would block
        # on every step queued before (the overlapped loop keeps one in flight). Calloc'd: a
        # page costs memory only once a row reaches it.
        self._host_table: torch.Tensor = (self.req_to_token if self.device.type == "cpu" else
                                          _lazy_zeros((max_request_num, max_sequence_length), _SLOT_DTYPE,
                                                      torch.device("cpu")))
        self._seq_len = torch.zeros(max_request_num, dtype=torch.int64)
        # A list, not a tensor: every step checks each of its rows, and reading one element of a
        # tensor costs microseconds (a decode step of 128 rows spent half its bookkeeping there).
        self._in_use: list[bool] = [False] * max_request_num
        # Popped from the end, so rows are handed out 0, 1, 2, ...
        self._free_rows: list[int] = list(range(max_request_num - 1, -1, -1))

    @property
    def can_use_req_size(self) -> int:
        """Number of free rows."""
        return len(self._free_rows)

    def alloc_req(self) -> int:
        """A free row, now in use with length 0; ``TooManyRequestsError`` when none is free."""
        if not self._free_rows:
            raise TooManyRequestsError(f"all {self.max_request_num} request slots are in use")
        req_idx = self._free_rows.pop()
        self._in_use[req_idx] = True
        self._seq_len[req_idx] = 0
        return req_idx

    def seq_len(self, req_idx: int) -> int:
        """Number of tokens (with KV slots) of the request in row ``req_idx``."""
        return int(self._seq_len[self._check_in_use(req_idx)])

    def append_tokens(self, req_idx: int, n: int) -> torch.Tensor:
        """Allocate ``n`` slots and write them at positions ``[len, len + n)`` of the row.

        Returns the slots (int32 on the pool's device). ``ValueError`` if the row would exceed
        ``max_sequence_length``; ``KVCacheFullError`` if the pool is short; nothing changes then.
        """
        return self.alloc_batch([req_idx], [n])

    def alloc_batch(self, req_idxs: list[int], n_new: list[int], expected_lens: list[int] | None = None) -> torch.Tensor:
        """Slots for a whole forward batch in one pool allocation, all-or-nothing.

        Request ``req_idxs[i]`` gets ``n_new[i]`` new tokens; the returned slots are concatenated
        in batch order (request 0's first) and written into each row after its current length.
        ``expected_lens``, if given, are the lengths the caller believes the rows have (the
        router's view of the cache); a mismatch is a ``ValueError`` before anything changes.
        """
        rows, counts, starts = self._check_batch(req_idxs, n_new, expected_lens)
        total = int(counts.sum())
        host_slots = self.mem_manager.alloc_host(total)  # raises before anything below changes
        slots = host_slots.to(self.device, non_blocking=True)   # (see MemoryManager.alloc)
        if total == 0:
            return slots
        # Row and position of every new token, in batch order, without a per-request loop.
        tok_rows = torch.repeat_interleave(rows, counts)
        first_of_req = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        tok_pos = torch.repeat_interleave(starts, counts) + (torch.arange(total) - first_of_req)
        self._host_table[tok_rows, tok_pos] = host_slots
        if self._host_table is not self.req_to_token:
            # One host-to-device copy for both index columns.
            tok_rows, tok_pos = torch.stack([tok_rows, tok_pos]).to(self.device, non_blocking=True)
            self.req_to_token[tok_rows, tok_pos] = slots
        self._seq_len[rows] = starts + counts
        return slots

    def share_prefix(self, req_idx: int, slots: torch.Tensor) -> None:
        """Start an empty row with slots that another holder keeps too (a cached prefix):
        positions [0, n) get ``slots``, each one more reference. ``ValueError`` (nothing
        changes) if the row is not empty, is too short, or a slot is free."""
        req_idx = self._check_in_use(req_idx)
        n = int(slots.numel())
        if int(self._seq_len[req_idx]) != 0:
            raise ValueError(f"request {req_idx} already holds {int(self._seq_len[req_idx])} tokens: a prefix goes first")
        if n > self.max_sequence_length:
            raise ValueError(f"a prefix of {n} tokens exceeds max_sequence_length={self.max_sequence_length}")
        self.mem_manager.incref(slots)
        self._host_table[req_idx, :n] = slots.to("cpu", _SLOT_DTYPE)
        if self._host_table is not self.req_to_token:
            self.req_to_token[req_idx, :n] = self._host_table[req_idx, :n].to(self.device, non_blocking=True)
        self._seq_len[req_idx] = n

    def slots(self, req_idx: int, start: int, end: int) -> torch.Tensor:
        """The slots of the row's positions [start, end) (a copy, on the host, where the pool counts
        references; read from the table's host copy, so no device wait); ``ValueError`` past its length."""
        req_idx = self._check_in_use(req_idx)
        if not 0 <= start <= end <= int(self._seq_len[req_idx]):
            raise ValueError(f"positions [{start}, {end}) are not all in request {req_idx}'s row "
                             f"of {int(self._seq_len[req_idx])} tokens")
        return self._host_table[req_idx, start:end].clone()

    def truncate(self, req_idx: int, new_len: int) -> None:
        """Drop the tokens at positions >= ``new_len`` and free their slots (e.g. rejected drafts)."""
        self.truncate_batch([req_idx], [new_len])

    def truncate_batch(self, req_idxs: list[int], new_lens: list[int]) -> None:
        """``truncate`` of several distinct rows, their slots freed in one call: a verify step drops
        every drafting request's rejected tokens at once (one free a request cost 0.6 ms a step at
        batch 32 on an H100's host). All-or-nothing: on ``ValueError`` no row changes."""
        rows = [self._check_in_use(r) for r in req_idxs]
        if len(set(rows)) != len(rows) or len(new_lens) != len(rows):
            raise ValueError(f"cannot truncate rows {req_idxs} to lengths {new_lens}: one length per distinct row")
        dropped = []
        for row, new_len in zip(rows, new_lens):
            cur = int(self._seq_len[row])
            if not _is_int(new_len) or not 0 <= new_len <= cur:
                raise ValueError(f"cannot truncate request {row} of length {cur} to {new_len!r}")
            if new_len < cur:
                dropped.append(self._host_table[row, new_len:cur])
        if not dropped:
            return
        self.mem_manager.free(torch.cat(dropped))
        for row, new_len in zip(rows, new_lens):
            self._seq_len[row] = new_len

    def free_req(self, req_idx: int) -> None:
        """Free every slot of the row, then the row itself."""
        req_idx = self._check_in_use(req_idx)
        cur = int(self._seq_len[req_idx])
        if cur:
            self.mem_manager.free(self._host_table[req_idx, :cur])
        self._seq_len[req_idx] = 0
        self._in_use[req_idx] = False
        self._free_rows.append(req_idx)

    def _check_in_use(self, req_idx: int) -> int:
        """``req_idx`` as a plain int; ``ValueError`` unless it names a row in use."""
        if type(req_idx) is not int:            # the common case first: a plain int needs no conversion
            if not _is_int(req_idx):
                raise ValueError(f"request index {req_idx!r} out of range [0, {self.max_request_num})")
            req_idx = operator.index(req_idx)
        if not 0 <= req_idx < self.max_request_num:
            raise ValueError(f"request index {req_idx!r} out of range [0, {self.max_request_num})")
        if not self._in_use[req_idx]:
            raise ValueError(f"request index {req_idx} is not allocated")
        return req_idx

    def _check_batch(
        self, req_idxs: list[int], n_new: list[int], expected_lens: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Validated (rows, counts, current lengths) as int64 CPU tensors; ``ValueError`` on any misuse."""
        req_idxs, n_new = list(req_idxs), list(n_new)
        if len(req_idxs) != len(n_new):
            raise ValueError(f"req_idxs and n_new differ in length ({len(req_idxs)} vs {len(n_new)})")
        req_idxs = [self._check_in_use(req_idx) for req_idx in req_idxs]
        if len(set(req_idxs)) != len(req_idxs):
            raise ValueError(f"a request appears twice in one batch: {req_idxs}")
        for n in n_new:
            if not (type(n) is int or _is_int(n)) or n < 0:
                raise ValueError(f"number of new tokens must be a non-negative integer, got {n!r}")
        n_new = [n if type(n) is int else operator.index(n) for n in n_new]
        rows = torch.tensor(req_idxs, dtype=torch.int64)
        counts = torch.tensor(n_new, dtype=torch.int64)
        cur_lens = self._seq_len[rows]
        if expected_lens is not None:
            mismatch = cur_lens != torch.tensor(expected_lens, dtype=torch.int64)
            if bool(mismatch.any()):
                i = int(mismatch.nonzero()[0])
                raise ValueError(
                    f"request row {req_idxs[i]} holds {int(cur_lens[i])} cached tokens, the batch says {expected_lens[i]}"
                )
        new_lens = cur_lens + counts
        too_long = new_lens > self.max_sequence_length
        if bool(too_long.any()):
            i = int(too_long.nonzero()[0])
            raise ValueError(
                f"request {req_idxs[i]} would reach {int(new_lens[i])} tokens, "
                f"more than max_sequence_length={self.max_sequence_length}"
            )
        return rows, counts, cur_lens
