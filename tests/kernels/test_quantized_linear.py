"""quantized_linear: the twin's dequantization against gguf-py's, the C kernel against F.linear on
the dequantized weight, QuantizedWeight's cuts against the same cuts of the dense matrix."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmserve.kernels import QuantizedWeight, embedding, linear, set_backend
from llmserve.kernels.quantized_linear import (
    QTYPES,
    build_library,
    kernel_available,
    quantized_linear_kernel,
    quantized_linear_torch,
    stack_rows,
)

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="no C compiler: the quantized kernel cannot be built")


def gguf_weight(qtype: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random [n, k] matrix quantized by gguf-py, as our QuantizedWeight and as gguf-py's
    dequantized float32 values."""
    dense = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quantize(dense, GGMLQuantizationType[qtype])
    ref = np.asarray(dequantize(blocks, GGMLQuantizationType[qtype]), dtype=np.float32).reshape(n, k)
    return QuantizedWeight.from_gguf(qtype, blocks, (n, k)), torch.from_numpy(ref)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("qtype", QTYPES)
def test_twin_dequantizes_exactly_as_gguf_py(qtype):
    w, ref = gguf_weight(qtype, 7, 96)
    assert w.shape == (7, 96)
    assert torch.equal(w.dequantize(), ref)


# Rows of x for both of the kernel's paths, each with 0..3 rows past its last 4-row tile (which
# go through a tile of 3, 2 or 1 rows): 1..13 the small-M path (decode, verify steps of 1 + 1..10
# drafts), 64..67 the blocked one (from BLOCK_M = 64 rows in quantized_linear.c).
SMALL_M, BLOCKED_M = range(1, 14), range(64, 68)


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [*SMALL_M, *BLOCKED_M])
# n not a multiple of the kernel's 4-row weight tiles, and a k of 2 and of 5 blocks
@pytest.mark.parametrize("n,k", [(13, 64), (40, 160)])
def test_kernel_matches_linear_on_the_dequantized_weight(qtype, m, n, k):
    """Against the torch twin (F.linear on the dequantized weight, gguf-py's values as tested
    above): every row of y, so a leftover-row tile that skipped, repeated or misplaced a row fails."""
    w, _ = gguf_weight(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    got = quantized_linear_kernel(x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert rel_err(got, quantized_linear_torch(x, w)) < 1e-5     # only the order of the float32 sums differs


@needs_kernel
def test_kernel_keeps_leading_dims_and_takes_no_rows():
    w, ref = gguf_weight("Q4_1", 8, 64)
    x = torch.randn(2, 3, 64)
    assert rel_err(quantized_linear_kernel(x, w), F.linear(x, ref)) < 1e-5
    assert quantized_linear_kernel(torch.empty(0, 64), w).shape == (0, 8)


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])        # AVX2, and no vector extensions
def test_other_instruction_sets_compute_the_same(march):
    """The kernel is built for the machine it runs on: its AVX2 and plain-C byte conversions
    must agree with this machine's build (AVX-512 on the project's CPUs)."""
    lib = build_library(["-O2", f"-march={march}", "-fopenmp", "-shared", "-fPIC"])
    for qtype in QTYPES:
        w, ref = gguf_weight(qtype, 9, 96)
        for m in (5, 6, 7, 66):          # 1, 2 and 3 rows past a 4-row tile; the blocked path
            x = torch.randn(m, 96)
            assert rel_err(quantized_linear_kernel(x, w, lib), F.linear(x, ref)) < 1e-5, (qtype, m)


def test_linear_and_embedding_take_dense_or_quantized_weights():
    w, ref = gguf_weight("Q8_0", 12, 64)
    x = torch.randn(3, 64)
    bias = torch.randn(12)
    assert rel_err(linear(x, w, bias), F.linear(x, ref, bias)) < 1e-5
    assert torch.equal(linear(x, ref, bias), F.linear(x, ref, bias))
    ids = torch.tensor([[3, 0], [11, 3]])
    assert torch.equal(embedding(ids, w), F.embedding(ids, ref))
    assert torch.equal(embedding(ids, ref), F.embedding(ids, ref))


def test_torch_backend_runs_the_twin():
    w, ref = gguf_weight("Q4_0", 6, 64)
    x = torch.randn(2, 64)
    set_backend("torch")
    try:
        assert torch.equal(linear(x, w), F.linear(x, ref))     # the twin: dequantize, then F.linear
    finally:
        set_backend(None)


@pytest.mark.parametrize("qtype", QTYPES)
def test_cuts_match_the_dense_matrix(qtype):
    w, ref = gguf_weight(qtype, 10, 128)
    assert torch.equal(w.narrow(0, 2, 5).dequantize(), ref[2:7])
    assert torch.equal(w.narrow(1, 32, 64).dequantize(), ref[:, 32:96])
    assert torch.equal(w.index_rows(torch.tensor([9, 0, 9])).dequantize(), ref[[9, 0, 9]])
    padded = w.pad_rows(3).dequantize()
    assert torch.equal(padded[:10], ref) and not padded[10:].any()
    with pytest.raises(ValueError, match="whole blocks"):
        w.narrow(1, 16, 32)


def test_stack_rows():
    a, ra = gguf_weight("Q4_1", 4, 64, seed=1)
    b, rb = gguf_weight("Q4_1", 6, 64, seed=2)
    c, rc = gguf_weight("Q8_0", 2, 64, seed=3)
    same = stack_rows([a, b])
    assert isinstance(same, QuantizedWeight) and torch.equal(same.dequantize(), torch.cat([ra, rb]))
    mixed = stack_rows([a, c, rb])      # two formats and a dense tensor: dequantized
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, torch.cat([ra, rc, rb]))
    assert torch.equal(stack_rows([ra, rb]), torch.cat([ra, rb]))


def test_rejects_inconsistent_weights():
    w, _ = gguf_weight("Q4_1", 4, 64)
    with pytest.raises(ValueError, match="offsets"):
        QuantizedWeight("Q4_0", w.qs, w.d, w.m)
    with pytest.raises(ValueError, match="unsupported"):
        QuantizedWeight("Q5_K", w.qs, w.d)


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES)
def test_a_row_gets_the_same_bits_in_any_batch(qtype):
    """Every path sums each output in one order (by a transpose of a tile's sums, or one at a
    time), so a request's logits do not depend on what else is in its batch: a row's bits are
    the same in a 4-row tile or one of 3, 2 or 1 rows, on the small-M path (M = 1..13) or the
    blocked one (64..67), at any place in x."""
    w, _ = gguf_weight(qtype, 70, 192)
    x = torch.randn(67, 192, generator=torch.Generator().manual_seed(5))
    full = quantized_linear_kernel(x, w)     # blocked, 3 rows past its last 4-row tile
    for m in [*SMALL_M, *BLOCKED_M]:
        for start in sorted({0, min(3, 67 - m), 67 - m}):
            assert torch.equal(quantized_linear_kernel(x[start:start + m], w), full[start:start + m]), (m, start)
