"""Host <-> device copies for the sampler: its small per-row columns sent to the device and its
results read back, without waiting for the device (on a GPU the worker's overlapped loop keeps the
step queued before running while the host prepares this one), and in as few copies as it can.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np


def on(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of ``values`` on ``device``, copied without waiting for the device: a blocking
    copy (``torch.tensor(values, device=...)`` makes one) would wait for the step queued before
    it, which the overlapped loop keeps running while this one is prepared."""
    return columns_on(device, (values, dtype))[0]


def columns_on(device: torch.device, *columns: tuple[list | np.ndarray, torch.dtype | None]) -> list[torch.Tensor]:
    """``on`` for several columns (values: a list or a numpy array; dtype) at once: on a GPU one
    copy from pinned memory (the columns side by side as bytes, each at an 8-byte boundary, viewed
    back on the device without a kernel), since each copy costs a launch and a transfer however
    small it is."""
    host = [torch.as_tensor(values, dtype=dtype) for values, dtype in columns]
    if device.type == "cpu":
        return host
    sizes = [t.numel() * t.element_size() for t in host]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + (size + 7) // 8 * 8)
    staging = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=True)
    for t, offset, size in zip(host, offsets, sizes):
        staging[offset : offset + size] = t.view(torch.uint8)
    # The caching host allocator keeps the staging buffer until the copy is done.
    packed = staging.to(device, non_blocking=True)
    return [packed[offset : offset + size].view(t.dtype) for t, offset, size in zip(host, offsets, sizes)]


def copy_to_host(device_out: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
    """Copies of the tensors on the host that do not wait for the device, and an event recorded after
    them that says when they are done (None on the CPU: done already)."""
    host = {name: t.to("cpu", non_blocking=True) for name, t in device_out.items()}
    ready = None
    if any(t.is_cuda for t in device_out.values()):
        ready = torch.cuda.Event()
        ready.record()
    return host, ready


def read_to_host(device_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``copy_to_host``, waited for: every tensor read back with one wait for the device."""
    host, ready = copy_to_host(device_out)
    if ready is not None:
        ready.synchronize()
    return host


def row_indices(selected: list[bool], device: torch.device) -> torch.Tensor:
    """The indices of the selected batch rows, as an index tensor."""
    return on([i for i, is_selected in enumerate(selected) if is_selected], device, torch.long)
