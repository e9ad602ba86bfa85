"""Autotuning for kernels whose best tiles depend on the GPU and the shape: `triton.autotune`, with
a benchmark that fits inside a model's start-up and a launch that also runs in the interpreter.

A decode step's linear layers are bound by reading their weights, and how fast a tile reads them
depends on the card (H100 or H200), the weight's format and the shape: too few programs leave SMs
idle, too many bytes a thread spill registers. So the quantized linears (`dequant_linear`) try a
handful of tiles on the first call for each key (the weight's shape, the format, a bucket of the
row count: `rows_bucket`) and keep the fastest for the life of the process; the choice between
`skinny_gemm` and cuBLAS does the same through `faster`.

When tuning happens: the first call of a key, which must not be inside a CUDA-graph capture
(timing synchronizes). The decode graphs run each batch bucket once eagerly before capturing it
(`cuda_graph._StepGraphs._capture`) and `TpPartBaseModel.warm_up` runs every row bucket of every
quantized weight (`llmserve.quantization.weights.warm_up`), so serving never tunes; `bench`
refuses with a clear error inside a capture.

How a choice is timed (`bench`): the kernels judged here run for 3-60 us, less than it takes
Python to launch one, so timing single calls between CUDA events measures the host. On an H200
that timer read 60-180 us for a 5 us GEMV and its picks were arbitrary: of two FP8 8B steps at
batch 1 one took 4.71 ms and the other 2.83, against 2.79 and 2.79 with this one (one call,
alternated; 4-bit 3.18 and 3.44 against 3.09 and 3.09). `bench` replays CUDA graphs instead: a graph of
``REPS`` calls, each after a read of a buffer twice the L2 cache (a decode step reads every
weight from HBM, so a tile must not be judged on weights L2 still holds), less a graph of the
reads alone. A few milliseconds a choice, where Triton's default spends ~0.15 s. What costs at
start-up is compiling each config once (Triton then keeps it on disk for later starts).

A kernel timed alone is not timed as a step runs it, between other kernels, under PDL: the bf16
one-row GEMVs' tiles picked this way made the 8B step slower, so they are not tuned (see
kernels/gemv.py's `TILES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import triton

from .backend import launcher, next_pow2, pdl

# Row counts that share a tuning: a decode step's batch and a prompt's tokens vary step to step,
# and tiles that win at 40 rows win at 50. Above the last bucket one tuning serves all.
ROW_BUCKETS = (16, 32, 64, 128, 256, 512)
WARMUP, REPS, REPLAYS = 2, 10, 5

_flush: dict[torch.device, torch.Tensor] = {}


def rows_bucket(rows: int) -> int:
    """The bucket of `ROW_BUCKETS` a product of ``rows`` rows is tuned for."""
    return min(max(ROW_BUCKETS[0], next_pow2(rows)), ROW_BUCKETS[-1])


def _flush_buffer() -> torch.Tensor:
    device = torch.device("cuda", torch.cuda.current_device())
    if device not in _flush:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) or (64 << 20)
        # A plain tensor even when the first bench runs under inference mode: a later one outside
        # it (a forward under no_grad) writes it too, which an inference tensor refuses.
        with torch.inference_mode(False):
            _flush[device] = torch.ones(2 * l2 // 4, dtype=torch.int32, device=device)
    return _flush[device]


def _replays_ms(calls: Callable[[], Any]) -> list[float]:
    """Milliseconds of each of `REPLAYS` replays of a CUDA graph of ``calls()``, run once first
    (compiles, first-call work) outside the graph."""
    calls()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)        # ~0.1 ms: the replay is launched before the GPU reaches start
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph                             # its memory pool goes with it
    return times


def _refuse_in_capture() -> None:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a kernel would be autotuned inside a CUDA-graph capture: run the shape once "
                           "before capturing (see kernels/autotune.py)")


def bench(kernel_call: Callable[[], Any], quantiles: Sequence[float] = (0.5, 0.2, 0.8)) -> list[float]:
    """Milliseconds of one ``kernel_call`` after the L2 cache is flushed, at ``quantiles`` of
    `REPLAYS` graph replays (`triton.autotune`'s ``do_bench`` hook): a graph of `REPS` calls each
    after a read of twice the L2, less a graph of the reads alone."""
    _refuse_in_capture()
    flush = _flush_buffer()
    for _ in range(WARMUP):
        kernel_call()

    def flushed_calls(call: bool) -> Callable[[], None]:
        def calls() -> None:
            for _ in range(REPS):
                flush.max()
                if call:
                    kernel_call()
        return calls

    with_calls = sorted(_replays_ms(flushed_calls(True)))
    reads = sorted(_replays_ms(flushed_calls(False)))
    per_call = [max(0.0, w - r) / REPS for w, r in zip(with_calls, reads)]
    return [per_call[min(len(per_call) - 1, int(q * len(per_call)))] for q in quantiles]


# `fastest`'s choices, by the caller's key, and the median milliseconds each choice took when it
# was made (`decisions`). Worker processes run one step at a time on one thread: no lock.
_fastest: dict[Any, Any] = {}
_timed: dict[Any, list[float]] = {}

T = TypeVar("T")


def fastest(key: Any, choices: Sequence[T], run: Callable[[T], Any]) -> T:
    """The choice whose ``run(choice)`` is fastest (the same product by several routes or tiles),
    timed by `bench` on the first call of ``key`` and remembered. Inside a CUDA-graph capture an
    unmeasured key gets the first choice, untimed and not remembered (the graphs run each shape
    eagerly before capturing it, so serving's keys are measured by then)."""
    if key not in _fastest:
        if torch.cuda.is_current_stream_capturing():
            return choices[0]
        times = [bench(lambda c=c: run(c))[0] for c in choices]
        _fastest[key] = choices[times.index(min(times))]
        _timed[key] = times
    return _fastest[key]


def decisions() -> list[dict[str, Any]]:
    """What `fastest` chose so far, for a benchmark's JSON: each key, its choice and the choices'
    median milliseconds (a choice between close times may differ from run to run)."""
    return [{"key": repr(key), "choice": repr(choice), "ms": [round(t, 4) for t in _timed.get(key, [])]}
            for key, choice in _fastest.items()]


def faster(key: Any, candidate: Callable[[], Any], baseline: Callable[[], Any]) -> bool:
    """Whether ``candidate`` runs faster than ``baseline`` (`fastest` of the two; inside a capture
    an unmeasured key answers True, the caller's choice)."""
    return fastest(key, (True, False), lambda c: candidate() if c else baseline())


def autotune(configs: list[triton.Config], key: list[str], prune: Callable | None = None):
    """`triton.autotune` with `bench`; ``prune(configs, named_args, **constexprs)`` returns the
    configs that fit a call (and may complete them with derived sizes)."""
    return triton.autotune(configs=configs, key=key, do_bench=bench,
                           prune_configs_by={"early_config_prune": prune} if prune else None)


def fitting_configs(tuner, args: dict[str, Any], constexprs: dict[str, Any]) -> list[triton.Config]:
    """The configs ``tuner`` would try for a call with these arguments (after its pruning)."""
    prune = tuner.early_config_prune
    return list(prune(tuner.configs, args, **constexprs)) if prune else list(tuner.configs)


def launch(tuner, t: torch.Tensor, grid: Callable[[dict], tuple], args: dict[str, Any],
           constexprs: dict[str, Any], config: triton.Config | None = None) -> None:
    """Run the autotuned kernel ``tuner`` (``args``: its runtime arguments by name, in order;
    ``constexprs``: the ones the caller fixes). On the GPU the tuner picks the config; with
    ``config`` given, or in Triton's interpreter (CPU tensors, where timing means nothing), that
    config or the first that fits runs."""
    constexprs = {**constexprs, **pdl(t)}    # its kernels take PDL (kernels/backend.py)
    if config is None and t.is_cuda:
        tuner[grid](*args.values(), **constexprs)
        return
    config = config or fitting_configs(tuner, args, constexprs)[0]
    meta = {**constexprs, **config.all_kwargs()}
    launcher(tuner.fn, t)[grid(meta)](*args.values(), **meta)
