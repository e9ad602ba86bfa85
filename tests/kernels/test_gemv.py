"""gemv: the Triton kernel against the linear layer it replaces, and `linear`'s routing to it;
gemv_act_and_mul against the linear layer and the activation it fuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICES, compile_for_hopper, linear_reference, randn, rng

from llmserve.kernels import backend, quantized_linear
from llmserve.kernels.gemv import (
    ACT_AND_MUL_TILES, ACTIVATIONS, TILES, gemv_act_and_mul_triton, gemv_triton, takes_gemv,
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
def test_every_swept_tile_matches_the_linear_layer(device, K):
    """Tiles `decode_linear.py --sweep` times, the defaults first, at a power-of-two K and at one of
    7 x 512 (Gemma 2's hidden size: chunks narrower than the widest, more rows)."""
    g = rng(K)
    x = randn(g, 1, K, dtype=torch.bfloat16, device=device)
    w = randn(g, 40, K, dtype=torch.bfloat16, device=device, scale=K ** -0.5)
    want = linear_reference(x, w, None)
    for tiles in (TILES, (4, 1024, 4), (2, 512, 4), (8, 1024, 4), (16, 512, 4), (2, 2048, 8)):
        torch.testing.assert_close(gemv_triton(x, w, tiles=tiles), want, atol=1e-2, rtol=1.6e-2, msg=str(tiles))
    gate_up = F.linear(x.float(), w.float()).to(torch.bfloat16)
    for tiles in (ACT_AND_MUL_TILES, (4, 512, 4), (2, 1024, 4), (16, 512, 4)):
        got = gemv_act_and_mul_triton(x, w, "silu", tiles=tiles)
        torch.testing.assert_close(got, ACTIVATIONS["silu"](gate_up), atol=1e-2, rtol=1.6e-2, msg=str(tiles))


def test_the_gemv_that_pushes_compiles_for_hopper():
    """The epilogue that stores the row into the fused all-reduce's peers' buffers
    (`all_reduce_add_rmsnorm.push_row`), compiled for sm_90; its protocol is tested with the
    fused kernel's, in test_all_reduce_add_rmsnorm.py."""
    types = dict(X="*bf16", W="*bf16", Bias="*bf16", Y="*bf16", PushBuffers="*i64", PushEpochs="*i64")
    constexprs = dict(HAS_BIAS=False, HAS_LORA=False, EVEN_K=True, BLOCK_N=4, BLOCK_K=2048, VEC=8, BLOCK_R=16,
                      BLOCK_S=16, PUSH=True, RANK=1, WORLD=2, PDL=True)
    compile_for_hopper("llmserve.kernels.gemv", "_gemv_kernel", [(types, constexprs, 4)])
