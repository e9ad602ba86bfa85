"""gemv: the Triton kernel against the linear layer it replaces, and `linear`'s routing to it;
gemv_act_and_mul against the linear layer and the activation it fuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICES, linear_reference, randn, rng

from llmserve.kernels import autotune, backend, quantized_linear
from llmserve.kernels.gemv import (
    ACT_AND_MUL_CANDIDATES, ACTIVATIONS, GEMV_CANDIDATES, fastest_tiles, gemv_act_and_mul_triton, gemv_tile, gemv_triton,
    takes_gemv,
)

# (N, K): K a multiple of the 2048-wide chunk, a power of two below it, ragged K, N not a multiple of
# the 4-row block, one output feature.
SHAPES = [(8, 4096), (12, 64), (37, 100), (5, 2100), (1, 48)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_the_linear_layer(device, dtype, N, K, with_bias):
    g = rng(N * K)
    x = randn(g, 1, K, dtype=dtype, device=device)
    w = randn(g, N, K, dtype=dtype, device=device, scale=K ** -0.5)
    bias = randn(g, N, dtype=dtype, device=device) if with_bias else None
    got = gemv_triton(x, w, bias)
    assert got.shape == (1, N) and got.dtype == dtype
    # One rounding of an fp32 sum: within a unit in the last place of the exact result, as cuBLAS is.
    torch.testing.assert_close(got, linear_reference(x, w, bias), atol=1e-5 if dtype == torch.float32 else 1e-2,
                               rtol=1e-5 if dtype == torch.float32 else 1.6e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_keeps_leading_dims_and_reads_a_row_strided_weight(device):
    g = rng(3)
    big = randn(g, 24, 130, dtype=torch.bfloat16, device=device)
    w = big[:, :96]  # a slice of a wider matrix: rows 130 apart (a TP shard of a fused weight)
    x = randn(g, 1, 1, 96, dtype=torch.bfloat16, device=device)
    got = gemv_triton(x, w)
    assert got.shape == (1, 1, 24)
    torch.testing.assert_close(got, linear_reference(x, w, None), atol=1e-2, rtol=1.6e-2)


def test_linear_sends_only_one_half_precision_row_to_gemv(monkeypatch):
    calls = []
    monkeypatch.setattr(quantized_linear, "gemv", lambda x, w, b=None: calls.append(x.shape) or F.linear(x, w, b))
    # The two-row call is skinny_gemm's, whose Triton kernel can't run on CPU tensors where
    # kernels are compiled (a GPU machine).
    monkeypatch.setattr(quantized_linear, "skinny_gemm", F.linear)
    w16 = torch.randn(8, 32, dtype=torch.bfloat16)
    backend.set_backend("triton")
    try:
        quantized_linear.linear(torch.randn(1, 32, dtype=torch.bfloat16), w16)
        quantized_linear.linear(torch.randn(2, 32, dtype=torch.bfloat16), w16)  # two rows: cuBLAS's
        quantized_linear.linear(torch.randn(1, 32), w16.float())  # fp32: cuBLAS's
        quantized_linear.linear(torch.randn(32, 2, dtype=torch.bfloat16).t()[:1], w16)  # strided row
    finally:
        backend.set_backend(None)
    assert calls == [(1, 32)]
    # The twin backend (CPU serving) never takes it.
    assert not takes_gemv(torch.randn(1, 32, dtype=torch.bfloat16), w16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("I,K", [(12, 64), (37, 100), (3, 2100)])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_act_and_mul_is_the_linear_layer_then_the_activation(device, dtype, I, K, act):
    """One launch for gate_up and the activation: within a rounding of the two launches it saves
    (`linear`, then silu_and_mul / gelu_and_mul), the gated output of a projection whose gate and
    up rows are two halves of one weight."""
    g = rng(I * K)
    x = randn(g, 1, K, dtype=dtype, device=device)
    w = randn(g, 2 * I, K, dtype=dtype, device=device, scale=K ** -0.5)
    got = gemv_act_and_mul_triton(x, w, act)
    assert got.shape == (1, I) and got.dtype == dtype
    want = ACTIVATIONS[act](linear_reference(x, w, None))
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 2e-3,
                               rtol=1e-5 if dtype == torch.float32 else 1.6e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K", [4096, 3584])
def test_every_candidate_tile_matches_the_linear_layer(device, K):
    """Each tile the card may pick (`GEMV_CANDIDATES`, `ACT_AND_MUL_CANDIDATES`) at a power-of-two K
    and at one of 7 x 512 (Gemma 2's hidden size: chunks narrower than the widest, more rows)."""
    g = rng(K)
    x = randn(g, 1, K, dtype=torch.bfloat16, device=device)
    w = randn(g, 40, K, dtype=torch.bfloat16, device=device, scale=K ** -0.5)
    want = linear_reference(x, w, None)
    for tiles in GEMV_CANDIDATES:
        torch.testing.assert_close(gemv_triton(x, w, tiles=tiles), want, atol=1e-2, rtol=1.6e-2, msg=str(tiles))
    gate_up = F.linear(x.float(), w.float()).to(torch.bfloat16)
    for tiles in ACT_AND_MUL_CANDIDATES:
        got = gemv_act_and_mul_triton(x, w, "silu", tiles=tiles)
        torch.testing.assert_close(got, ACTIVATIONS["silu"](gate_up), atol=1e-2, rtol=1.6e-2, msg=str(tiles))


def test_the_fastest_tiles_are_timed_once_a_shape(monkeypatch):
    """On a GPU each key times its candidates once, as a step reads the weight (`stream_ms`),
    those that come to the same tile at this K once, and keeps the fastest; the interpreter runs
    the first untimed."""
    timed = []
    speed = dict(zip(GEMV_CANDIDATES, [3.0, 1.0, 4.0, 2.0, 2.5, 1.5, 3.5, 5.0]))
    weights = []
    monkeypatch.setattr(autotune, "stream_ms", lambda run, weight: weights.append(weight) or speed[run(weight)])
    monkeypatch.setattr(autotune, "_fastest", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU torch has none)

    def run(tiles, weight):
        timed.append(tiles)
        return tiles

    on_gpu = type("Row", (), {"is_cuda": True})()
    o, qkv = torch.empty(8, 4096), torch.empty(8, 3584)
    assert fastest_tiles("o", on_gpu, o, GEMV_CANDIDATES, run) == GEMV_CANDIDATES[1]
    assert fastest_tiles("o", on_gpu, o, GEMV_CANDIDATES, run) == GEMV_CANDIDATES[1]
    assert timed == list(GEMV_CANDIDATES)                   # every tile differs at 4096; timed once
    assert all(w is o for w in weights)                     # over the layer's own weight
    timed.clear()
    # at 3584 (7 x 512) the first, fourth and fifth are all 16 x 512: six tiles to time
    assert [gemv_tile(3584, t) for t in GEMV_CANDIDATES] == [(16, 512, 4), (8, 512, 4), (4, 512, 4), (16, 512, 4),
                                                              (16, 512, 4), (2, 512, 4), (16, 512, 8), (8, 512, 8)]
    assert fastest_tiles("qkv", on_gpu, qkv, GEMV_CANDIDATES, run) == GEMV_CANDIDATES[1]
    assert timed == [GEMV_CANDIDATES[i] for i in (0, 1, 2, 5, 6, 7)]
    assert fastest_tiles("cpu", torch.zeros(1), o, GEMV_CANDIDATES, run) == GEMV_CANDIDATES[0]
