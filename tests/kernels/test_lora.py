"""lora_shrink / lora_expand: the twins against a per-request fp64 reference, Triton against the
twins (segments of several lengths, the base model's segments, adapters below the pool's rank,
a stacked A, an expand into a column slice of a wider output)."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, i32, randn, rng, tol

from llmserve.kernels.lora import lora_expand_torch, lora_expand_triton, lora_shrink_torch, lora_shrink_triton

SLOTS, R_SUB, M = 3, 16, 2            # pool slots, rank block, projections stacked in A
RANKS = [16, 4, 8]                   # each slot's adapter rank
CASES = {                            # (segment lengths, their slots)
    "decode": ([1, 1, 1, 1, 1], [0, -1, 2, 0, 1]),
    "mixed": ([7, 1, 19, 3, 0], [1, 0, -1, 2, 1]),
}


def _inputs(case: str, K: int, N: int, dtype, device: str):
    lens, slots = CASES[case]
    g = rng(K + N)
    n = sum(lens)
    a = randn(g, SLOTS, M * R_SUB, K, dtype=dtype, device=device, scale=0.3)
    b = randn(g, SLOTS, N, R_SUB, dtype=dtype, device=device, scale=0.3)
    for slot, r in enumerate(RANKS):     # the pool keeps the padding of a lower rank at zero
        a.view(SLOTS, M, R_SUB, K)[slot, :, r:] = 0
        b[slot, :, r:] = 0
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return dict(
        x=randn(g, n, K, dtype=dtype, device=device), a=a, b=b, y=randn(g, n, N + 5, dtype=dtype, device=device),
        scaling=torch.tensor([0.5, 2.0, 1.25], device=device), b_start=i32(starts, device), b_len=i32(lens, device),
        b_slot=i32(slots, device), slot_rank=i32(RANKS, device), max_len=max(lens),
    )


def _run(shrink, expand, t: dict, j: int) -> torch.Tensor:
    """y with the j-th stacked projection's product added to its columns [2, 2 + N)."""
    seg = (t["b_start"], t["b_len"], t["b_slot"], t["slot_rank"], t["max_len"])
    s = shrink(t["x"], t["a"], *seg, R_SUB)
    y = t["y"].clone()
    expand(y[:, 2 : 2 + t["b"].shape[1]], s[:, j * R_SUB : (j + 1) * R_SUB], t["b"], t["scaling"], *seg)
    return y


@pytest.mark.parametrize("case", list(CASES))
def test_twins_match_reference(case):
    t = _inputs(case, 24, 20, torch.float32, "cpu")
    for j in range(M):
        want = t["y"].double().clone()
        for start, n, slot in zip(t["b_start"].tolist(), t["b_len"].tolist(), t["b_slot"].tolist()):
            if slot >= 0:
                a = t["a"][slot, j * R_SUB : (j + 1) * R_SUB].double()
                want[start : start + n, 2:22] += t["x"][start : start + n].double() @ a.t() @ t["b"][slot].double().t() \
                    * float(t["scaling"][slot])
        got = _run(lora_shrink_torch, lora_expand_torch, t, j)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("K,N", [(24, 20), (130, 70)])
def test_triton_matches_twin(device, dtype, case, K, N):
    t = _inputs(case, K, N, dtype, device)
    for j in range(M):
        want = _run(lora_shrink_torch, lora_expand_torch, t, j)
        got = _run(lora_shrink_triton, lora_expand_triton, t, j)
        torch.testing.assert_close(got, want, **tol(dtype))
