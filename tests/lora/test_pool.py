"""LoraBatch at one row: the Triton path (a one-row shrink, the product added in the GEMV's
epilogue, gate_up's activation in the same launch) against the twins (the linear layer, then
lora_add), for each projection group of a pool holding adapters of two ranks below its own, and
a row of the base model. Half precision (the GEMVs take no other): fp16 in Triton's interpreter on
a CPU, bf16 with ``LLMSERVE_TEST_DEVICE=cuda``."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from llmserve.kernels import backend
from llmserve.kernels.gemv import ACTIVATIONS, gemv_act_and_mul, takes_gemv
from llmserve.lora.adapter import TARGET_MODULES, LoraAdapter, projection_shape
from llmserve.lora.pool import GROUPS, LoraBatch, LoraPool, lora_segments
from parity_utils import TEST_DEVICE

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300)
RANKS = (4, 8)          # the adapters in slots 0 and 1; the pool's slots hold rank 16 (slot 2 empty)
DEVICE = torch.device(TEST_DEVICE)
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16    # the interpreter has no bf16
TOL = dict(atol=2e-2, rtol=2e-2) if DTYPE == torch.bfloat16 else dict(atol=1e-2, rtol=1e-2)

# tests/conftest.py has Triton interpret kernels only on a machine without a GPU.
pytestmark = pytest.mark.skipif(DEVICE.type == "cpu" and torch.cuda.is_available(),
                                reason="Triton kernels on CPU tensors need the interpreter, set only without a GPU")


def _adapter(rank: int, seed: int) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(CONFIG.num_hidden_layers):
        for module in TARGET_MODULES.values():
            n_in, n_out = projection_shape(CONFIG, module)
            weights[(layer, module)] = (torch.randn(rank, n_in, generator=g) * 0.2, torch.randn(n_out, rank, generator=g) * 0.2)
    return LoraAdapter(f"r{rank}", "", rank, 1.5 + seed, weights)


@pytest.fixture(scope="module")
def pool() -> LoraPool:
    pool = LoraPool(CONFIG, 3, 16, 0, 1, DTYPE, DEVICE)
    for slot, rank in enumerate(RANKS):
        pool.load(slot, _adapter(rank, slot))
    return pool


def _batch(pool: LoraPool, slot: int) -> LoraBatch:
    seg_start, rows, max_len = lora_segments([slot], [1], pool.max_loras)
    block = torch.tensor(seg_start + rows, dtype=torch.int32, device=DEVICE)
    return LoraBatch(pool, block[: len(seg_start)], block[len(seg_start) :], max_len)


def _on(name: str, fn):
    backend.set_backend(name)
    try:
        return fn()
    finally:
        backend.set_backend(None)


@pytest.mark.parametrize("slot", [0, 1, -1])
@pytest.mark.parametrize("group", list(GROUPS))
def test_one_row_epilogue_matches_the_twins(pool, group, slot):
    g = torch.Generator().manual_seed(len(group) + slot)
    n_in = pool.groups[group].a.shape[-1]
    n_out = sum(pool.groups[group].splits)
    x = torch.randn(1, n_in, generator=g).to(DEVICE, DTYPE)
    weight = (torch.randn(n_out, n_in, generator=g) * n_in ** -0.5).to(DEVICE, DTYPE)
    bias = torch.randn(n_out, generator=g).to(DEVICE, DTYPE) if group == "qkv" else None
    batch = _batch(pool, slot)
    assert _on("triton", lambda: takes_gemv(x, weight))    # the GEMV's path, not linear + lora_add
    got = _on("triton", lambda: batch.linear(1, group, x, weight, bias))
    want = _on("torch", lambda: batch.linear(1, group, x, weight, bias))
    torch.testing.assert_close(got, want, **TOL)
    if group == "gate_up":
        act = "silu"
        got = _on("triton", lambda: gemv_act_and_mul(x, weight, act, lora=batch.row(1, group, x)))
        torch.testing.assert_close(got, ACTIVATIONS[act](want), **TOL)


def test_a_pipeline_stage_holds_its_own_layers_adapter_weights(pool):
    """At pp > 1 a stage's pool has room for its layers only, and reads each layer's adapter
    weights where the whole model's pool has them."""
    stage = LoraPool(CONFIG, 3, 16, 0, 1, DTYPE, DEVICE, layers=range(1, 2))
    for slot, rank in enumerate(RANKS):
        stage.load(slot, _adapter(rank, slot))
    assert stage.nbytes * CONFIG.num_hidden_layers == pool.nbytes
    assert list(stage.layers) == [1]
    for group in GROUPS:
        for got, want in zip(stage.layers[1][group][:2], pool.layers[1][group][:2]):
            assert torch.equal(got, want), group
