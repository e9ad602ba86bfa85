"""`autotune`'s timers on a GPU: they must time the kernels, not the host that launches them, and
a GEMV's weight as a decode step reads it (from HBM). The choice logic (`fastest`, `faster`,
`fastest_tiles`) is tested with fake timers in test_gemv.py and test_skinny_gemm.py."""

import pytest
import torch

from kernel_test_utils import CUDA
from llmserve.kernels import autotune
from llmserve.kernels.gemv import gemv_triton

pytestmark = pytest.mark.skipif(not CUDA, reason="times CUDA graphs")


def _copy_bandwidth() -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = autotune.bench(lambda: dst.copy_(src))[0]
    return 2 * src.numel() / (ms * 1e-3)


def test_bench_times_a_small_kernel_not_its_launch():
    """A GEMV over 8 MiB runs for a few microseconds; its launch from Python takes longer. Timed
    between events one call at a time (the timer before 2026-11-28) it read 60-180 us on an H200."""
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    ms = autotune.bench(lambda: gemv_triton(x, w, tiles=(4, 2048, 4)))
    assert 0 < ms[0] < 0.02, ms
    assert ms[1] <= ms[0] <= ms[2]


def test_stream_ms_reads_the_weight_from_hbm():
    """An 8 MiB weight fits the L2 cache; timed over copies it cannot read faster than memory."""
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    ms = autotune.stream_ms(lambda weight: gemv_triton(x, weight, tiles=(4, 2048, 4)), w)
    read = w.numel() * w.element_size() / (ms * 1e-3)
    assert ms < 0.02, ms
    assert read < 1.15 * _copy_bandwidth(), (read, ms)
