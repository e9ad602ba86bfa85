"""lora_shrink / lora_expand: the twins against a per-request fp64 reference, Triton against the
twins (segments of several lengths, the base model's segments, adapters below the pool's rank,
two projections stacked in A and B, an expand into a column slice of a wider output)."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, i32, randn, rng, tol

from llmserve.kernels.lora import lora_expand_torch, lora_expand_triton, lora_shrink_torch, lora_shrink_triton

SLOTS, R_SUB = 3, 16                 # pool slots, rank block
RANKS = [16, 4, 8]                   # each slot's adapter rank
CASES = {                            # (segment lengths, their slots)
    "decode": ([1, 1, 1, 1, 1], [0, -1, 2, 0, 1]),
    "mixed": ([7, 1, 19, 3, 0], [1, 0, -1, 2, 1]),
}


def _inputs(case: str, K: int, splits: tuple[int, ...], dtype, device: str):
    lens, slots = CASES[case]
    g = rng(K + sum(splits))
    n, m = sum(lens), len(splits)
    a = randn(g, SLOTS, m * R_SUB, K, dtype=dtype, device=device, scale=0.3)
    b = randn(g, SLOTS, sum(splits), R_SUB, dtype=dtype, device=device, scale=0.3)
    for slot, r in enumerate(RANKS):     # the pool keeps the padding of a lower rank at zero
        a.view(SLOTS, m, R_SUB, K)[slot, :, r:] = 0
        b[slot, :, r:] = 0
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return dict(
        x=randn(g, n, K, dtype=dtype, device=device), a=a, b=b, splits=splits,
        y=randn(g, n, sum(splits) + 5, dtype=dtype, device=device),
        scaling=torch.tensor([0.5, 2.0, 1.25], device=device), b_start=i32(starts, device), b_len=i32(lens, device),
        b_slot=i32(slots, device), slot_rank=i32(RANKS, device), max_len=max(lens),
    )


def _run(shrink, expand, t: dict) -> torch.Tensor:
    """y with the stacked projections' products added to its columns from 2 on (a slice of a wider output)."""
    seg = (t["b_start"], t["b_len"], t["b_slot"], t["slot_rank"], t["max_len"])
    s = shrink(t["x"], t["a"], *seg, R_SUB)
    y = t["y"].clone()
    expand(y[:, 2 : 2 + sum(t["splits"])], s, t["b"], t["scaling"], *seg, t["splits"])
    return y


@pytest.mark.parametrize("case", list(CASES))
def test_twins_match_reference(case):
    t = _inputs(case, 24, (20, 13), torch.float32, "cpu")
    want = t["y"].double().clone()
    for start, n, slot in zip(t["b_start"].tolist(), t["b_len"].tolist(), t["b_slot"].tolist()):
        if slot < 0:
            continue
        x = t["x"][start : start + n].double()
        col = 2
        for j, width in enumerate(t["splits"]):
            a = t["a"][slot, j * R_SUB : (j + 1) * R_SUB].double()
            b = t["b"][slot, col - 2 : col - 2 + width].double()
            want[start : start + n, col : col + width] += x @ a.t() @ b.t() * float(t["scaling"][slot])
            col += width
    got = _run(lora_shrink_torch, lora_expand_torch, t)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("K,splits", [(24, (20, 13)), (130, (70,)), (64, (96, 32, 32))])
def test_triton_matches_twin(device, dtype, case, K, splits):
    t = _inputs(case, K, splits, dtype, device)
    want = _run(lora_shrink_torch, lora_expand_torch, t)
    got = _run(lora_shrink_triton, lora_expand_triton, t)
    torch.testing.assert_close(got, want, **tol(dtype))
