"""LoraBatch at one row: the Triton path (a one-row shrink, the product added in the GEMV's
epilogue, gate_up's activation in the same launch) against the twins (the linear layer, then
lora_add), for each projection group of a pool holding adapters of two ranks below its own, and
a row of the base model. Half precision (the GEMVs take no other): fp16 in Triton's interpreter on
a CPU, bf16 with ``LLMSERVE_TEST_DEVICE=cuda``."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from llmserve.kernels import backend
from llmserve.kernels.gemv import ACTIVATIONS, gemv_act_and_mul, takes_gemv
from llmserve.lora.adapter import TARGET_MODULES, LoraAdapter, projection_shape
from llmserve.kernels.quantized_linear import linear
from llmserve.lora.pool import GROUPS, WEIGHT_ATTRS, LoraBatch, LoraPool, lora_segments
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
    n_in = pool.groups[group].a[0].shape[-1]
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


def _layer_weights(pool: LoraPool, seed: int) -> list[SimpleNamespace]:
    """Random base weights of the pool's layers, each group's fused weight at its attribute."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in pool.model_layers:
        w = SimpleNamespace()
        for group, attr in WEIGHT_ATTRS.items():
            n_in, n_out = pool.groups[group].a[0].shape[-1], sum(pool.groups[group].splits)
            setattr(w, attr, (torch.randn(n_out, n_in, generator=g) * n_in ** -0.5).to(DEVICE, DTYPE))
        layers.append(w)
    return layers


def test_widened_weights_keep_their_values_and_both_routes_agree():
    """`widen` puts every slot's A below each base weight (the layer keeps the same values, now
    the first rows of the wide tensor, the old tensors freed; the pool the same A, its last rows),
    and at several rows
    the wide route (one GEMM over the widened weight, the expand from its tail) adds what the
    other route does (shrink, base projection, expand), for every group."""
    pool = LoraPool(CONFIG, 3, 16, 0, 1, DTYPE, DEVICE)
    for slot, rank in enumerate(RANKS):
        pool.load(slot, _adapter(rank, slot))
    layers = _layer_weights(pool, 0)
    bases = [{attr: getattr(w, attr).clone() for attr in WEIGHT_ATTRS.values()} for w in layers]
    adapters = {(layer, group): a.clone()
                for layer, groups in pool.layers.items() for group, (a, _, _) in groups.items()}
    old = [weakref.ref(getattr(w, attr)) for w in layers for attr in WEIGHT_ATTRS.values()]
    pool.widen(layers)
    gc.collect()
    assert all(ref() is None for ref in old)     # the weights are not held twice
    for layer, (w, base) in enumerate(zip(layers, bases)):
        for group, attr in WEIGHT_ATTRS.items():
            wide, a = pool.wide[(layer, group)], pool.layers[layer][group][0]
            assert torch.equal(getattr(w, attr), base[attr]) and getattr(w, attr).is_contiguous()
            assert getattr(w, attr).data_ptr() == wide.data_ptr() and torch.equal(a, adapters[(layer, group)])
            assert torch.equal(wide[base[attr].shape[0] :], a.reshape(-1, a.shape[-1]))
    # A load after the widening lands in the wide tensors' A rows.
    before, n = pool.wide[(1, "down")].clone(), CONFIG.hidden_size
    pool.load(1, _adapter(RANKS[1], 5))
    after = pool.wide[(1, "down")]
    assert torch.equal(after[:n], before[:n]) and not torch.equal(after[n:], before[n:])
    seg_start, rows, max_len = lora_segments([0, 1, -1, 0, 1], [1, 2, 1, 1, 1], pool.max_loras)
    block = torch.tensor(seg_start + rows, dtype=torch.int32, device=DEVICE)
    batch = LoraBatch(pool, block[: len(seg_start)], block[len(seg_start) :], max_len)
    g = torch.Generator().manual_seed(3)
    for group, attr in WEIGHT_ATTRS.items():
        weight = getattr(layers[1], attr)
        x = torch.randn(6, weight.shape[1], generator=g).to(DEVICE, DTYPE)
        if DEVICE.type == "cpu":
            assert batch.route(1, group, x, weight) == "wide"
        got = batch._wide(1, group, x, weight, None)
        want = batch._beside(1, group, x, weight, None)
        torch.testing.assert_close(got, want, **TOL)
        assert not torch.equal(got, _on("torch", lambda: linear(x, weight)))    # the adapters added something


def test_widen_leaves_row_parallel_groups_at_tensor_parallelism():
    """At tp > 1 the row-parallel groups' outputs are all-reduced in place (contiguous only), so
    their weights stay as they are; the column-parallel ones are widened."""
    pool = LoraPool(CONFIG, 3, 16, 0, 2, DTYPE, DEVICE)
    pool.widen(_layer_weights(pool, 1))
    assert sorted({group for _, group in pool.wide}) == ["gate_up", "qkv"]
