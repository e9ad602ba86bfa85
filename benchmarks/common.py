"""Helpers shared by the benchmark scripts: timing, memory-bandwidth measurement, output.

Nothing here touches CUDA at import time. On a CPU device every timer falls back to
``time.perf_counter`` so the scripts can be smoke-tested on a machine without a GPU; those
numbers mean nothing beyond "it runs".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent

# Zeroed before every timed call so that no call finds its inputs in L2 left there by the
# previous one (the H100's L2 is 50 MB). Triton's do_bench does the same.
L2_FLUSH_BYTES = 256 * 1024**2


def remove_script_dir_from_sys_path() -> None:
    """Take this folder off ``sys.path`` (call it right after importing this module).

    ``python benchmarks/<script>.py`` puts this folder first on ``sys.path``, which is how the
    scripts find this module. Left there, ``benchmarks/kernels.py`` would shadow the PyPI package
    ``kernels`` that transformers probes for (and imports, when it finds no version metadata).
    """
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR]


# -- devices and dtypes ----------------------------------------------------------------------
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
}


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """--device, --dtype and --json, which every benchmark takes."""
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 on CUDA and fp32 elsewhere (CPU bf16 matmuls are slow and pointless here)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise SystemExit(f"unknown dtype {name!r}; expected auto or one of {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: how the tables and the JSON name a dtype."""
    return str(dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


# -- timing ----------------------------------------------------------------------------------
def cuda_time_ms(
    fn: Callable[[], Any],
    warmup: int = 10,
    iters: int = 100,
    device: torch.device | str | None = None,
    flush_l2: bool = True,
) -> float:
    """Median time of one call of ``fn`` in milliseconds.

    On CUDA each call sits between two CUDA events and is preceded by an L2 flush, as in
    ``triton.testing.do_bench``: the flush keeps the GPU busy while the host launches ``fn``,
    so the events see the kernels' GPU time rather than Python launch overhead. On CPU,
    ``time.perf_counter`` around each call.
    """
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize(device)
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


class IntervalTimer:
    """Times a sequence of intervals on ``device`` without synchronising between them.

    CUDA: an event pair per interval (read back by ``elapsed_ms`` after one synchronize), so a
    step's time covers its GPU work plus any GPU idle time the host caused inside it.
    CPU: ``time.perf_counter``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: list[tuple[Any, Any]] = []
        self._open: Any = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self._marks.append((self._open, end))
        self._open = None

    def elapsed_ms(self) -> list[float]:
        """Milliseconds of each interval, in order (synchronises the device)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) for s, e in self._marks]
        return [(e - s) * 1e3 for s, e in self._marks]


def measure_copy_bandwidth(device: torch.device | str, nbytes: int | None = None, iters: int = 10) -> float:
    """Achievable memory bandwidth in bytes/s: a device-to-device copy of ``nbytes`` (1 GiB on
    CUDA, 64 MiB on CPU), counting the bytes read plus the bytes written, median of ``iters``.

    This, not the data-sheet peak, is what the benchmarks' bandwidth floors divide by: it is what
    a kernel that only streams memory actually gets on this card.
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = 1024**3 if device.type == "cuda" else 64 * 1024**2
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(functools.partial(dst.copy_, src), warmup=3, iters=iters, device=device, flush_l2=False)
    del src, dst  # free them before empty_cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


# -- output ----------------------------------------------------------------------------------
def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table; cells are rendered with ``str`` (format numbers before)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |"

    separator = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(cells[0]), separator, *(line(r) for r in cells[1:])])


def environment(device: torch.device) -> dict[str, Any]:
    """Where and with what the numbers were taken, for the JSON output."""
    import triton

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device_name(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 1024**3, 1)
    return info


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def wall_median_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median wall-clock milliseconds of ``fn`` (host work included), the device synchronised
    around each call, after one untimed call (generators, kernels)."""
    fn()
    times = []
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def capture_graph(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """A CUDA graph of one call of ``fn`` (run once before, outside the capture: compiles, warm-up)
    and what the captured call returned (its tensors are filled by each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds a replay of ``graph``, the mean of ``replays`` back to back (after one untimed)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Microseconds a call, from a CUDA graph of `calls` calls replayed `replays` times."""
    graph, _ = capture_graph(lambda: [fn() for _ in range(calls)])
    return replay_ms(graph, replays) * 1e3 / calls


@contextlib.contextmanager
def gc_paused():
    """Collect garbage, then keep Python's collector off for the block (as `timeit` does): a
    collection inside a timed loop stalls the GPU for as long as it runs. Seen in offline.py on an
    H100: after the torch.compile'd HF peer had run, our next batch's mean step read 24.1 ms, 7.19
    without the peer, and 7.19 with the peer once the collector was paused."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
