"""skinny_gemm: the Triton kernel (both tile sets) against the linear layer it replaces, and
`linear`'s routing to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICE_DTYPES, DEVICES, linear_reference, randn, rng

from llmserve.kernels import autotune, backend, quantized_linear
from llmserve.kernels.skinny_gemm import FEW_ROWS_TILES, WIDE_TILES, skinny_gemm_triton

# (M, N, K): one 16-row tile, a ragged one, the most rows (a 64-row tile); K a multiple of the
# 256-wide chunk, a power of two below it, and ragged; N not a multiple of the 32-column block.
SHAPES = [(2, 64, 512), (5, 37, 100), (16, 96, 64), (33, 40, 300), (64, 8, 48)]
# Half precision only (`linear` keeps fp32 on cuBLAS); no bf16 on CPU, where Triton's interpreter
# multiplies bf16 tiles wrong (tl.dot of raw bf16 operands).
HALF = [p for p in DEVICE_DTYPES if p.values[1] != torch.float32]


@pytest.mark.parametrize("device,dtype", HALF)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tiles", [FEW_ROWS_TILES, WIDE_TILES], ids=["few-rows-tiles", "wide-tiles"])
def test_skinny_gemm_matches_the_linear_layer(device, dtype, M, N, K, with_bias, tiles):
    g = rng(M * N * K)
    x = randn(g, M, K, dtype=dtype, device=device)
    w = randn(g, N, K, dtype=dtype, device=device, scale=K ** -0.5)
    bias = randn(g, N, dtype=dtype, device=device) if with_bias else None
    got = skinny_gemm_triton(x, w, bias, tiles=tiles)
    assert got.shape == (M, N) and got.dtype == dtype
    # One rounding of an fp32 sum: within a unit in the last place of the exact result, as cuBLAS is.
    torch.testing.assert_close(got, linear_reference(x, w, bias), atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_skinny_gemm_keeps_leading_dims_and_reads_strided_rows(device):
    g = rng(4)
    w = randn(g, 24, 130, dtype=torch.float16, device=device)[:, :96]  # rows 130 apart (a TP shard)
    x = randn(g, 3, 2, 200, dtype=torch.float16, device=device)[..., :96]  # rows 200 apart
    got = skinny_gemm_triton(x, w)
    assert got.shape == (3, 2, 24)
    torch.testing.assert_close(got, linear_reference(x, w, None), atol=1e-2, rtol=1.6e-2)


def test_linear_sends_what_the_tiles_win_here(monkeypatch):
    """2-16 rows of any weight; 17-64 rows only of an LM-head-wide one; one row is gemv's, fp32 and
    anything else cuBLAS's."""
    calls = []
    monkeypatch.setattr(quantized_linear, "skinny_gemm", lambda x, w, b=None: calls.append((x.shape[0], w.shape[0])) or F.linear(x, w, b))
    monkeypatch.setattr(quantized_linear, "gemv", F.linear)  # as test_gemv's routing test says why
    narrow = torch.randn(8, 32, dtype=torch.bfloat16)
    wide = torch.randn(65536, 32, dtype=torch.bfloat16)
    backend.set_backend("triton")
    try:
        for rows in (1, 2, 16, 17, 64):
            quantized_linear.linear(torch.randn(rows, 32, dtype=torch.bfloat16), narrow)
        for rows in (17, 64, 65):
            quantized_linear.linear(torch.randn(rows, 32, dtype=torch.bfloat16), wide)
        quantized_linear.linear(torch.randn(4, 32), narrow.float())  # fp32
    finally:
        backend.set_backend(None)
    assert calls == [(2, 8), (16, 8), (17, 65536), (64, 65536)]


def test_the_faster_route_is_timed_once_a_key_and_never_in_a_capture(monkeypatch):
    """`autotune.faster` (skinny_gemm against cuBLAS on a GPU): each key is timed once, the verdict
    kept; a key first met inside a CUDA-graph capture is not timed and answers True."""
    timed = []
    times = {"ours": 1.0, "cublas": 2.0, "slow": 3.0}
    monkeypatch.setattr(autotune, "bench", lambda call: timed.append(call()) or [times[timed[-1]]])
    monkeypatch.setattr(autotune, "_fastest", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU torch has none)
    assert autotune.faster("a", lambda: "ours", lambda: "cublas")
    assert not autotune.faster("b", lambda: "slow", lambda: "cublas")
    assert timed == ["ours", "cublas", "slow", "cublas"]
    assert autotune.faster("a", lambda: "slow", lambda: "cublas") and not autotune.faster("b", lambda: "ours", lambda: "cublas")
    assert len(timed) == 4                                           # remembered, not retimed
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert autotune.faster("c", lambda: "slow", lambda: "cublas") and len(timed) == 4
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not autotune.faster("c", lambda: "slow", lambda: "cublas")   # measured once out of it
