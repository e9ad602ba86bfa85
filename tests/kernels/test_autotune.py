"""`autotune.bench` on a GPU: it must time the kernels, not the host that launches them. The choice logic (`fastest`, `faster`) is tested with a fake timer in
test_skinny_gemm.py."""

import pytest
import torch

from kernel_test_utils import CUDA
from llmserve.kernels import autotune
from llmserve.kernels.gemv import gemv_triton

pytestmark = pytest.mark.skipif(not CUDA, reason="times CUDA graphs")


def test_bench_times_a_small_kernel_not_its_launch():
    """A GEMV over 8 MiB runs for a few microseconds; its launch from Python takes longer. Timed
    between events one call at a time (the timer before 2026-11-28) it read 60-180 us on an H200."""
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    ms = autotune.bench(lambda: gemv_triton(x, w, tiles=(4, 2048, 4)))
    assert 0 < ms[0] < 0.02, ms
    assert ms[1] <= ms[0] <= ms[2]
