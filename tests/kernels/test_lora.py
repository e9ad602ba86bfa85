"""lora_add: the twin against a per-token fp64 reference, Triton against the twin (tokens of an
adapter scattered through the batch, the base model's tokens, a slot without tokens, adapters
below the pool's rank, a slot's tokens over several row tiles, stacked projections, an output
that is a column slice of a wider one with tails in its projections' columns, 256-column expand
blocks, decode and prompt-sized tiles, the shrink cut into many K splits with a short last one,
then summed, a graph's rows longer than its batch); the expand from every slot's shrink of every
token (the wide route's), its twin against lora_add's; at one row, the GEMVs' epilogue after the
one-row shrink against linear then the twin; shrink_plan's splits; lora_segments' grouping."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, i32, linear_reference, randn, rng, tol

from llmserve.kernels import lora as lora_kernels
from llmserve.kernels.gemv import ACTIVATIONS, TILES, gemv_act_and_mul_triton, gemv_triton
from llmserve.kernels.lora import (MAX_K_SPLITS, lora_add_torch, lora_add_triton, lora_expand_wide_torch,
                                   lora_expand_wide_triton, lora_row, shrink_plan)
from llmserve.lora.pool import lora_segments

SLOTS, R_SUB = 4, 16                 # pool slots (slot 3 holds an adapter no token uses), rank block
RANKS = [16, 4, 8, 16]               # each slot's adapter rank
CASES = {                            # (requests' new tokens, their slots)
    "decode": ([1, 1, 1, 1, 1], [0, -1, 2, 0, 1]),
    "mixed": ([7, 1, 19, 3, 0], [1, 0, -1, 2, 1]),
    # slot 2's 37 tokens span three 16-row tiles; slot 1, between two others, has none
    "long": ([20, 1, 3, 17, 2], [2, 0, -1, 2, 3]),
}


def _inputs(case: str, K: int, splits: tuple[int, ...], dtype, device: str):
    q_lens, slots = CASES[case]
    g = rng(K + sum(splits))
    n, m = sum(q_lens), len(splits)
    a = randn(g, SLOTS, m * R_SUB, K, dtype=dtype, device=device, scale=0.3)
    b = randn(g, SLOTS, sum(splits), R_SUB, dtype=dtype, device=device, scale=0.3)
    for slot, r in enumerate(RANKS):     # the pool keeps the padding of a lower rank at zero
        a.view(SLOTS, m, R_SUB, K)[slot, :, r:] = 0
        b[slot, :, r:] = 0
    seg_start, rows, max_len = lora_segments(slots, q_lens, SLOTS)
    return dict(
        x=randn(g, n, K, dtype=dtype, device=device), a=a, b=b, splits=splits, slots=slots, q_lens=q_lens,
        y=randn(g, n, sum(splits) + 5, dtype=dtype, device=device),
        scaling=torch.tensor([0.5, 2.0, 1.25, 3.0], device=device), slot_rank=i32(RANKS, device),
        seg_start=i32(seg_start, device), rows=i32(rows, device), max_len=max_len,
    )


def _run(add, t: dict) -> torch.Tensor:
    """y with the stacked projections' products added to its columns from 2 on (a slice of a wider output)."""
    y = t["y"].clone()
    add(y[:, 2 : 2 + sum(t["splits"])], t["x"], t["a"], t["b"], t["scaling"], t["slot_rank"], t["seg_start"],
        t["rows"], t["max_len"], t["splits"], R_SUB)
    return y


def test_segments_group_each_adapters_tokens():
    seg_start, rows, max_len = lora_segments([1, 0, -1, 1, 2], [2, 1, 3, 2, 0], 4)
    assert seg_start == [0, 1, 5, 5, 5] and rows == [2, 0, 1, 6, 7] and max_len == 4


@pytest.mark.parametrize("case", list(CASES))
def test_twin_matches_reference(case):
    t = _inputs(case, 24, (20, 13), torch.float32, "cpu")
    want = t["y"].double().clone()
    token_slots = [slot for slot, n in zip(t["slots"], t["q_lens"]) for _ in range(n)]
    for row, slot in enumerate(token_slots):
        if slot < 0:
            continue
        x = t["x"][row].double()
        col = 2
        for j, width in enumerate(t["splits"]):
            a = t["a"][slot, j * R_SUB : (j + 1) * R_SUB].double()
            b = t["b"][slot, col - 2 : col - 2 + width].double()
            want[row, col : col + width] += x @ a.t() @ b.t() * float(t["scaling"][slot])
            col += width
    torch.testing.assert_close(_run(lora_add_torch, t).double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("K,splits", [(24, (20, 13)), (130, (70,)), (64, (96, 32, 32))])
def test_triton_matches_twin(device, dtype, case, K, splits):
    t = _inputs(case, K, splits, dtype, device)
    torch.testing.assert_close(_run(lora_add_triton, t), _run(lora_add_torch, t), **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_prompt_tiles_match_twin(device, dtype, monkeypatch):
    """Segments past DECODE_ROWS take the prompts' wider row tiles."""
    monkeypatch.setattr(lora_kernels, "DECODE_ROWS", 4)
    t = _inputs("mixed", 64, (96, 32, 32), dtype, device)
    torch.testing.assert_close(_run(lora_add_triton, t), _run(lora_add_torch, t), **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_k_splits_match_twin(device, dtype, case, monkeypatch):
    """K = 200 in blocks of 16 (13 blocks, the last one short) over 24 'SMs': 3 blocks a split, so
    5 splits of which the last holds one short block, then summed."""
    monkeypatch.setattr(lora_kernels, "SHRINK_BLOCK_K", 16)
    monkeypatch.setattr(lora_kernels, "_num_sms", lambda device: 24)
    plan = shrink_plan(200, 4 if case == "decode" else 5, 16, 32, 4, 24)
    assert (plan.block_k, plan.k_per_split, plan.k_splits) == (16, 48, 5)
    t = _inputs(case, 200, (70, 33), dtype, device)
    torch.testing.assert_close(_run(lora_add_triton, t), _run(lora_add_torch, t), **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_rows_longer_than_the_batch_match_twin(device, dtype, monkeypatch):
    """A CUDA graph's ``rows`` is the largest bucket's (padded with zeros past the batch's adapter
    tokens), longer than a smaller bucket's batch: only the segments' positions count, in K splits
    too (the sum covers the batch's rows)."""
    monkeypatch.setattr(lora_kernels, "SHRINK_BLOCK_K", 16)
    monkeypatch.setattr(lora_kernels, "_num_sms", lambda device: 24)
    t = _inputs("mixed", 200, (70, 33), dtype, device)
    want = _run(lora_add_torch, t)
    t["rows"] = torch.cat([t["rows"], torch.zeros(64, dtype=t["rows"].dtype, device=device)])
    torch.testing.assert_close(_run(lora_add_triton, t), want, **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_wide_expand_blocks_match_twin(device, dtype):
    """The expand's 256-column blocks: two projections of more than one block, each with a short
    last one."""
    assert lora_kernels.expand_block_n((300, 260)) == 256 and lora_kernels.expand_block_n((96, 32, 32)) == 32
    t = _inputs("mixed", 64, (300, 260), dtype, device)
    torch.testing.assert_close(_run(lora_add_triton, t), _run(lora_add_torch, t), **tol(dtype))


def _expand_from_all_slots(expand, t: dict) -> torch.Tensor:
    """`_run` for `lora_expand_wide`'s halves: every slot's shrink of every token (``x @ A_all^T``,
    rounded to x's dtype, as the widened GEMM's tail), as a column slice of a wider output too."""
    K = t["x"].shape[1]
    out = torch.cat([t["y"], (t["x"].double() @ t["a"].reshape(-1, K).double().t()).to(t["x"].dtype)], dim=1)
    y, s_all = out[:, 2 : 2 + sum(t["splits"])], out[:, t["y"].shape[1] :]
    expand(y, s_all, t["b"], t["scaling"], t["slot_rank"], t["seg_start"], t["rows"], t["max_len"], t["splits"], R_SUB)
    return out[:, : t["y"].shape[1]]


@pytest.mark.parametrize("case", list(CASES))
def test_expand_from_all_slots_twin_matches_lora_add(case):
    """The wide route's twin: a token's own slot's columns of every slot's shrink, expanded, is
    `lora_add`'s twin (which shrinks the token by its own slot only); other slots' columns unread."""
    t = _inputs(case, 24, (20, 13), torch.float64, "cpu")
    torch.testing.assert_close(_expand_from_all_slots(lora_expand_wide_torch, t), _run(lora_add_torch, t))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("K,splits", [(24, (20, 13)), (64, (96, 32, 32)), (64, (300, 260))])
def test_expand_from_all_slots_matches_twin(device, dtype, case, K, splits, monkeypatch):
    """The expand reading s by token row and slot (S_BY_ROW): decode and prompt-sized tiles."""
    t = _inputs(case, K, splits, dtype, device)
    want = _expand_from_all_slots(lora_expand_wide_torch, t)
    torch.testing.assert_close(_expand_from_all_slots(lora_expand_wide_triton, t), want, **tol(dtype))
    monkeypatch.setattr(lora_kernels, "DECODE_ROWS", 4)
    torch.testing.assert_close(_expand_from_all_slots(lora_expand_wide_triton, t), want, **tol(dtype))


def _one_row(slot: int, K: int, splits: tuple[int, ...], dtype, device: str) -> dict:
    """`_inputs` for a batch of one token on ``slot`` (-1: the base model's), and a base weight."""
    t = _inputs("decode", K, splits, dtype, device)
    seg_start, rows, max_len = lora_segments([slot], [1], SLOTS)
    t.update(x=t["x"][:1].contiguous(), seg_start=i32(seg_start, device), rows=i32(rows, device), max_len=max_len,
             w=randn(rng(K), sum(splits), K, dtype=dtype, device=device, scale=K ** -0.5))
    t["row"] = lora_row(t["x"], t["a"], t["b"], t["scaling"], t["slot_rank"], t["seg_start"], splits, R_SUB)
    return t


def _twin_after(y: torch.Tensor, t: dict) -> torch.Tensor:
    """``y`` (the base projection's output) with the twin's adapter product added."""
    lora_add_torch(y, t["x"], t["a"], t["b"], t["scaling"], t["slot_rank"], t["seg_start"], t["rows"],
                   t["max_len"], t["splits"], R_SUB)
    return y


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("slot", [0, 1, -1])
@pytest.mark.parametrize("K,splits", [(64, (96, 32, 32)), (130, (70,)), (24, (21, 6))])
def test_gemv_epilogue_matches_linear_then_twin(device, dtype, slot, K, splits):
    """One row: the shrink of `lora_row`, then the GEMV adding s @ B^T in its epilogue (blocks
    that span two projections, a rank below the pool's, the base model's row: nothing added)."""
    t = _one_row(slot, K, splits, dtype, device)
    bias = randn(rng(7), sum(splits), dtype=dtype, device=device)
    got = gemv_triton(t["x"], t["w"], bias, lora=t["row"])
    torch.testing.assert_close(got, _twin_after(linear_reference(t["x"], t["w"], bias), t), **tol(dtype))
    if slot < 0:    # nothing added: bit for bit the plain GEMV, at the same tiles (on a GPU each is
        # tuned on its own, and another tile sums in another order)
        torch.testing.assert_close(gemv_triton(t["x"], t["w"], bias, lora=t["row"], tiles=TILES),
                                   gemv_triton(t["x"], t["w"], bias, tiles=TILES), atol=0, rtol=0)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("K", [64, 130])
def test_row_shrink_over_several_chunks(device, dtype, K, monkeypatch):
    """The one-row shrink's loop over K in chunks of 16: 4 whole ones (no column masks), or 9 with
    a short last one."""
    monkeypatch.setattr(lora_kernels, "ROW_SHRINK_BLOCK_K", 16)
    t = _one_row(1, K, (40, 24), dtype, device)
    got = gemv_triton(t["x"], t["w"], lora=t["row"])
    torch.testing.assert_close(got, _twin_after(linear_reference(t["x"], t["w"], None), t), **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("slot", [2, -1])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_act_and_mul_epilogue_matches_linear_then_twin(device, dtype, slot, act):
    """gate_up at one row: gate and up each get their projection's product before the activation."""
    t = _one_row(slot, 40, (37, 37), dtype, device)
    got = gemv_act_and_mul_triton(t["x"], t["w"], act, lora=t["row"])
    want = ACTIVATIONS[act](_twin_after(linear_reference(t["x"], t["w"], None), t))
    torch.testing.assert_close(got, want, **tol(dtype))


def test_shrink_plan_covers_k_and_fills_a_wave():
    """Every plan cuts K into k_splits non-empty splits of whole blocks, at most MAX_K_SPLITS of
    them and about one wave of programs; on Llama-3-8B's shapes (H100, bf16, rank 16) the splits
    the module's docstring counts."""
    for k in (16, 24, 130, 4096, 14336):
        for busy in (1, 3, 9, 40, 200):
            plan = shrink_plan(k, busy, 16, 64, 2, 132)
            assert plan.k_per_split % plan.block_k == 0
            assert (plan.k_splits - 1) * plan.k_per_split < k <= plan.k_splits * plan.k_per_split
            assert plan.k_splits <= min(MAX_K_SPLITS, max(1, -(-132 // busy)))
    llama = {("qkv", 1): (4096, 1, 64), ("down", 1): (14336, 1, 16), ("qkv", 32): (4096, 9, 64),
             ("down", 32): (14336, 9, 16)}
    splits = {key: (p.k_per_split, p.k_splits)
              for key, (k, busy, block_r) in llama.items() for p in [shrink_plan(k, busy, 16, block_r, 2, 132)]}
    assert splits == {("qkv", 1): (128, 32), ("down", 1): (512, 28), ("qkv", 32): (384, 11), ("down", 32): (1024, 14)}
