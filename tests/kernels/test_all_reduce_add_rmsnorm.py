"""all_reduce_add_rmsnorm: the fused tensor-parallel kernel's protocol, on the CPU.

Each rank is a forked process running the kernel in Triton's interpreter; their buffers and flags
are shared memory allocated before the fork, so every process addresses every rank's at the same
address, as symmetric memory maps them on GPUs. Several calls in a row use both halves of the
buffers and reuse them. The GPU's two ranks are tests/common/test_custom_all_reduce.py's."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from kernel_test_utils import compile_for_hopper, cpu_triton, randn, rng, tol

from llmserve.kernels.add_rmsnorm import add_rmsnorm_forward_triton
from llmserve.kernels.all_reduce_add_rmsnorm import (
    PROGRAMS, PushTarget, all_reduce_add_rmsnorm_torch, all_reduce_add_rmsnorm_triton,
)
from llmserve.kernels.gemv import gemv_triton

CALLS = 3            # > 2: a buffer half is written again after a call that used the other
JOIN_S = 120         # a rank still waiting then is a protocol that hangs


def _fork_ranks(world: int, rank_main) -> None:
    """Run ``rank_main(rank)`` in a forked process per rank; every one must end well within JOIN_S."""
    ranks = [mp.get_context("fork").Process(target=rank_main, args=(r,)) for r in range(world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(JOIN_S)
    for p in ranks:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in ranks] == [0] * world, "a rank failed or hung (its traceback is above)"


def _empty_bits(dtype: torch.dtype) -> torch.dtype:
    return torch.int16 if torch.finfo(dtype).bits == 16 else torch.int32


def _run_ranks(world: int, addends: list[list[torch.Tensor]], h0: list[torch.Tensor], w: torch.Tensor,
               round_first: bool, delta_w: torch.Tensor | None,
               protocol: str = "flags") -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's h and norm after each call (``[world, calls, M, N]`` each)."""
    m, n = h0[0].shape
    dtype = h0[0].dtype
    rank_stride = m * n + 7     # not a multiple of a row: the kernel must not assume one
    size = 2 * world * rank_stride
    if protocol == "one-way":   # every byte 0xFF: "empty"
        buffers = [torch.full((size,), -1, dtype=_empty_bits(dtype)).view(dtype).share_memory_() for _ in range(world)]
    else:
        buffers = [torch.full((size,), float("nan"), dtype=dtype).share_memory_() for _ in range(world)]
    flags = [torch.zeros(PROGRAMS * world, dtype=torch.int64).share_memory_() for _ in range(world)]
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    flag_ptrs = None if protocol == "one-way" else torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    hs = torch.zeros(world, len(h0), m, n, dtype=dtype).share_memory_()
    ys = torch.zeros_like(hs).share_memory_()

    def rank_main(rank: int) -> None:
        epochs = torch.zeros(PROGRAMS, dtype=torch.int64)
        for call, (addend, h) in enumerate(zip(addends[rank], h0)):
            h = h.clone()
            ys[rank, call] = all_reduce_add_rmsnorm_triton(addend, h, w, 1e-6, round_first, buffer_ptrs, flag_ptrs,
                                                           epochs, rank, rank_stride, delta_w)
            hs[rank, call] = h

    _fork_ranks(world, rank_main)
    if protocol == "one-way":   # every rank emptied what its peers wrote, once read
        for rank, b in enumerate(buffers):
            assert bool((b.view(_empty_bits(dtype)) == -1).all()), rank
    else:
        for rank, f in enumerate(flags):   # every program heard every peer once a call; none signals itself
            expected = torch.full((PROGRAMS, world), len(h0), dtype=torch.int64)
            expected[:, rank] = 0
            assert torch.equal(f.view(PROGRAMS, world), expected), rank
    return hs, ys


@cpu_triton
@pytest.mark.parametrize("protocol", ["flags", "one-way"])
@pytest.mark.parametrize("family", ["llama", "gemma", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world,m,n", [(2, 1, 64), (2, PROGRAMS + 8, 96), (3, 2, 5000)],
                         ids=["one-row", "more-rows-than-programs", "three-ranks-chunked-rows"])
def test_every_rank_gets_the_twins_residual_and_the_add_rmsnorm_kernels_norm(world, m, n, dtype, family, protocol):
    round_first = family == "llama"     # Gemma's norms: the fp32 1 + w, one rounding
    g = rng(world * 1000 + m + n)
    addends = [[randn(g, m, n, dtype=dtype, device="cpu") for _ in range(CALLS)] for _ in range(world)]
    h0 = [randn(g, m, n, dtype=dtype, device="cpu", scale=3.0) for _ in range(CALLS)]
    w = randn(g, n, dtype=dtype, device="cpu")
    delta_w = 1.0 + randn(g, n, dtype=dtype, device="cpu").float() if family == "gemma2" else None
    if not round_first:
        w = 1.0 + w.float()
    hs, ys = _run_ranks(world, addends, h0, w, round_first, delta_w, protocol)
    for call in range(CALLS):
        h_twin = h0[call].clone()
        want = all_reduce_add_rmsnorm_torch([addends[r][call] for r in range(world)], h_twin, w, 1e-6, round_first,
                                            delta_w)
        # The same sum on the unfused path: the ranks' addends in rank order, then add_rmsnorm
        # (Gemma 2: with the sum's own norm).
        total = addends[0][call].clone()
        for r in range(1, world):
            total += addends[r][call]
        h_plain = h0[call].clone()
        plain = add_rmsnorm_forward_triton(h_plain, total, w, 1e-6, round_first, delta_w)
        for rank in range(world):
            what = f"rank {rank}, call {call}"
            # Without the delta norm the residual is one rounded add both ways; with it, as the
            # add_rmsnorm kernel has it.
            torch.testing.assert_close(hs[rank, call], h_plain, atol=0, rtol=0, msg=what)
            torch.testing.assert_close(hs[rank, call], h_twin, **(tol(dtype) if delta_w is not None else
                                                                   dict(atol=0, rtol=0)), msg=what)
            torch.testing.assert_close(ys[rank, call], plain, atol=0, rtol=0, msg=what)
            torch.testing.assert_close(ys[rank, call], want, **tol(dtype), msg=what)


@cpu_triton
@pytest.mark.parametrize("world", [2, 3])
def test_a_gemv_that_pushes_its_row_gives_what_the_kernels_push_gives(world):
    """One-way, batch-1 calls whose addend a GEMV pushed in its epilogue (``pushed=True``), between
    calls of two rows that the kernel pushes itself: every rank gets the rank-order sum of the
    GEMVs' outputs, added and normalised as `add_rmsnorm`, and the buffers end empty."""
    g = rng(11 + world)
    n, k, dtype = 96, 64, torch.float16
    weights = [randn(g, n, k, dtype=dtype, device="cpu", scale=k ** -0.5) for _ in range(world)]
    rows = [1, 2, 1, 1]                          # pushed, pushed by the kernel, pushed, pushed
    xs = [[randn(g, m, k, dtype=dtype, device="cpu") for m in rows] for _ in range(world)]
    h0 = [randn(g, m, n, dtype=dtype, device="cpu", scale=3.0) for m in rows]
    w = randn(g, n, dtype=dtype, device="cpu")
    rank_stride = 2 * n + 5
    empty = torch.int16
    buffers = [torch.full((2 * world * rank_stride,), -1, dtype=empty).view(dtype).share_memory_() for _ in range(world)]
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    hs = [torch.zeros(world, m, n, dtype=dtype).share_memory_() for m in rows]
    ys = [torch.zeros(world, m, n, dtype=dtype).share_memory_() for m in rows]

    def rank_main(rank: int) -> None:
        epochs = torch.zeros(PROGRAMS, dtype=torch.int64)
        push = PushTarget(buffer_ptrs, epochs, rank, rank_stride)
        for call, (x, h) in enumerate(zip(xs[rank], h0)):
            h = h.clone()
            one_row = x.shape[0] == 1
            addend = (gemv_triton(x, weights[rank], push=push) if one_row
                      else torch.cat([gemv_triton(r[None], weights[rank]) for r in x]))
            ys[call][rank] = all_reduce_add_rmsnorm_triton(addend, h, w, 1e-6, True, buffer_ptrs, None, epochs, rank,
                                                           rank_stride, pushed=one_row)
            hs[call][rank] = h

    _fork_ranks(world, rank_main)
    for rank, b in enumerate(buffers):
        assert bool((b.view(empty) == -1).all()), rank
    for call, (m, h_start) in enumerate(zip(rows, h0)):
        total = torch.cat([gemv_triton(r[None], weights[0]) for r in xs[0][call]])
        for r in range(1, world):
            total += torch.cat([gemv_triton(row[None], weights[r]) for row in xs[r][call]])
        h_plain = h_start.clone()
        plain = add_rmsnorm_forward_triton(h_plain, total, w, 1e-6, True)
        for rank in range(world):
            torch.testing.assert_close(hs[call][rank], h_plain, atol=0, rtol=0, msg=f"rank {rank}, call {call}")
            torch.testing.assert_close(ys[call][rank], plain, atol=0, rtol=0, msg=f"rank {rank}, call {call}")


@cpu_triton
def test_one_way_takes_a_nan_with_the_empty_bits():
    """An addend element whose bits are all ones (a NaN, the one-way buffers' "empty") arrives as
    a NaN, and the call ends: the push sends every NaN as the canonical one."""
    g = rng(7)
    m, n, dtype = 2, 64, torch.float16
    addends = [[randn(g, m, n, dtype=dtype, device="cpu") for _ in range(CALLS)] for _ in range(2)]
    addends[1][0].view(torch.int16)[1, 5] = -1
    h0 = [randn(g, m, n, dtype=dtype, device="cpu", scale=3.0) for _ in range(CALLS)]
    w = randn(g, n, dtype=dtype, device="cpu")
    hs, ys = _run_ranks(2, addends, h0, w, True, None, "one-way")
    for rank in range(2):
        assert bool(hs[rank, 0, 1, 5].isnan()) and bool(ys[rank, 0, 1].isnan().all())
        assert not bool(hs[rank, 0, 0].isnan().any()) and not bool(hs[rank, 1:].isnan().any())


def test_every_protocol_compiles_for_hopper():
    """The interpreter runs neither the PTX spin nor Triton's GPU passes: compile for sm_90 here
    (a block carried round the one-way wait loop once failed a layout pass there)."""
    def variant(dtype: str, world: int, one_way: bool, norm_delta: bool, pushed: bool = False) -> tuple[dict, dict, int]:
        types = {name: f"*{dtype}" for name in ("Addend", "H", "W", "DeltaW", "Y")}
        types.update(BufferPtrs="*i64", FlagPtrs="*i64", Epochs="*i64", eps="fp32")
        return types, dict(RANK=1, WORLD=world, WORLD_POW2=world, BLOCK_N=4096, ROUND_FIRST=not norm_delta,
                           NORM_DELTA=norm_delta, ONE_WAY=one_way, PUSHED=pushed, BITS=32 if dtype == "fp32" else 16,
                           SPIN_ASM=True, PDL=True), 8

    compile_for_hopper("llmserve.kernels.all_reduce_add_rmsnorm", "_all_reduce_add_rmsnorm_kernel", [
        variant("bf16", 2, False, False), variant("bf16", 2, True, False), variant("bf16", 4, True, True),
        variant("fp32", 4, True, False), variant("fp16", 2, False, True), variant("bf16", 2, True, False, pushed=True),
    ])
