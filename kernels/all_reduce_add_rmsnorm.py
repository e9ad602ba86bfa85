"""A tensor-parallel all-reduce, the residual add after it and the next RMSNorm in one kernel
(issue 34).

At tp > 1 each decoder layer ends its attention and its MLP with a row-parallel projection whose
per-rank outputs are summed over the ranks, added to the residual stream and normalised for the
next projection. Apart, that is an all-reduce kernel (copy in, barrier, read, barrier) and an
`add_rmsnorm` launch; here it is one launch with one barrier:

1. **push**: every program copies its rows of this rank's addend into each peer's symmetric
   buffer (peer-to-peer stores over NVLink), in the half of the buffer this call's epoch picks;
2. **signal**: it stores the epoch into each peer's flag for (this program, this rank), with
   release semantics at system scope, so that a peer that sees the flag also sees the rows;
3. **wait**: it spins until every peer's flag for this program in its own flags reaches the epoch
   (2 and 3: a thread per peer, all peers at once);
4. **reduce, add, norm**: it sums the ranks' addends of its rows in rank order (its own from the
   input, the others from its own buffer), and goes on as `add_rmsnorm`: ``h += sum`` (in place,
   rounded to h's dtype), then the norm of h; with a delta weight (Gemma 2 and 3, whose sublayer
   outputs are normalised before they join the residual stream) ``h += norm(sum)``.

Why no closing barrier: a rank's program can reach epoch ``e + 2`` and write into the half its
peer read at epoch ``e`` only after it saw the peer's program signal epoch ``e + 1``, and that
program signals only after its launch of epoch ``e`` has ended (stream order, which PDL keeps:
every program waits for the kernel before it first). So two halves suffice. For the same reason
the grid is a fixed ``PROGRAMS`` whatever the rows (row i is always program ``i % PROGRAMS``'s),
and every program signals and waits in every call, rows or not: each program's epoch then
advances once a call on every rank (``Epochs`` holds it, in this rank's memory).

**One-way** (``flag_ptrs=None``; `CustomAllReduce` behind ``LLMSERVE_FUSED_ALL_REDUCE=one-way``,
until it is measured on the GPUs): no flags. The buffers start "empty", every byte all ones (a NaN
bit pattern in every float dtype, which a push never writes: it turns any NaN into the canonical
one), and a program waits (3.) by reading its peers' rows of its own buffer until no element is
empty; after summing (4.) it empties them again (5.). A signal is a store whose landing the sender
must wait for before the flag may follow; here the data is the signal, so a call costs one trip
over NVLink, not two (the scheme of TensorRT-LLM's "Lamport" all-reduce). The same two halves:
a peer writes a half again two calls later, after this rank's next call has pushed to it, which
comes after this call emptied its rows.

**Pushed by the producer** (one-way only; `PushTarget`, ``pushed=True``): a one-row GEMV (the o or
down projection of a batch-1 decode step) stores its output into the peers' buffers itself, in
its epilogue (`push_row`), where this kernel's step 1 would; the kernel then only waits, sums,
adds, normalises and empties. The push leaves the critical path: each GEMV program sends its few
features as it ends, while the others still read their weights. The half is the one this
kernel's next call will use: row 0 is program 0's, whose epoch the GEMV reads (this kernel's last
call wrote it, and the GEMV runs after that call ended).

Sum order: rank 0's addend, then rank 1's, and so on, rounded to the dtype after each addition,
on every rank alike; so every rank's h gets the same bits, and they equal the custom one-shot
all-reduce's sum followed by `add_rmsnorm` (the torch twin below says it in torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .add_rmsnorm import add_rmsnorm_forward_torch, add_to_row, normalised_delta
from .backend import next_pow2, pdl, row_launch_config
from .rmsnorm import store_row_norm
from .triton_math import pdl_wait

# The grid, whatever the rows: see the module's docstring. 32 programs push and sum a batch of 32
# rows in one pass each; the ones without rows only signal and wait.
PROGRAMS = 32


@triton.jit
def _all_reduce_add_rmsnorm_kernel(Addend, H, W, DeltaW, Y, BufferPtrs, FlagPtrs, Epochs, M, N, stride_a, stride_h,
                                   stride_y, rank_stride, eps, RANK: tl.constexpr, WORLD: tl.constexpr,
                                   WORLD_POW2: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_FIRST: tl.constexpr,
                                   NORM_DELTA: tl.constexpr, ONE_WAY: tl.constexpr, PUSHED: tl.constexpr,
                                   BITS: tl.constexpr, SPIN_ASM: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = H.dtype.element_ty
    epoch = tl.load(Epochs + pid) + 1
    tl.store(Epochs + pid, epoch)
    half = (epoch % 2) * WORLD * rank_stride           # this epoch's half of every buffer

    # 1. push this rank's rows into its region of every peer's buffer (PUSHED: the producer did)
    if not PUSHED:
        for row in range(pid, M, programs):
            for off in range(0, N, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                mask = cols < N
                _push_chunk(tl.load(Addend + row * stride_a + cols, mask=mask), row * N + cols, mask, BufferPtrs,
                            half, rank_stride, RANK, WORLD, ONE_WAY)
    own = tl.load(BufferPtrs + RANK).to(tl.pointer_type(dtype)) + half
    if ONE_WAY:   # 3. wait until every peer's rows of this program have landed in this rank's buffer
        _peers_rows(own, pid, programs, M, N, rank_stride, RANK, WORLD, BLOCK_N, BITS, EMPTY=False)
    else:
        _signal_and_wait(FlagPtrs, epoch, pid, RANK, WORLD, WORLD_POW2, SPIN_ASM)
    tl.debug_barrier()
    # 4. sum in rank order, add to the residual, normalise (as _add_rmsnorm_kernel)
    for row in range(pid, M, programs):
        h_row = H + row * stride_h
        y_row = Y + row * stride_y
        if NORM_DELTA:   # the sum's own norm first: the sum is kept in Y (the norm's output, later)
            dsq = tl.zeros([BLOCK_N], tl.float32)
            for off in range(0, N, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                mask = cols < N
                total = _sum_in_rank_order(Addend + row * stride_a, own + row * N, rank_stride, cols, mask, RANK,
                                           WORLD)
                tl.store(y_row + cols, total, mask=mask)
                d = total.to(tl.float32)
                dsq += d * d
            d_rstd = tl.math.rsqrt(tl.sum(dsq, 0) / N + eps)
            tl.debug_barrier()                        # the next pass reads what this one wrote
        sq = tl.zeros([BLOCK_N], tl.float32)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = cols < N
            if NORM_DELTA:   # as _add_rmsnorm_kernel: the normalised sum, rounded to the dtype
                d = normalised_delta(tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32), d_rstd, DeltaW, cols,
                                     mask, H, ROUND_FIRST)
            else:
                d = _sum_in_rank_order(Addend + row * stride_a, own + row * N, rank_stride, cols, mask, RANK,
                                       WORLD).to(tl.float32)
            sq += add_to_row(h_row, d, cols, mask)
        rstd = tl.math.rsqrt(tl.sum(sq, 0) / N + eps)
        tl.debug_barrier()                            # the second pass reads what the first wrote
        store_row_norm(h_row, W, y_row, N, rstd, BLOCK_N, ROUND_FIRST)
    if ONE_WAY:   # 5. empty the peers' rows just read, for the call after next (every thread's reads first)
        tl.debug_barrier()
        _peers_rows(own, pid, programs, M, N, rank_stride, RANK, WORLD, BLOCK_N, BITS, EMPTY=True)


@triton.jit
def _peers_rows(own, pid, programs, M, N, rank_stride, RANK: tl.constexpr, WORLD: tl.constexpr,
                BLOCK_N: tl.constexpr, BITS: tl.constexpr, EMPTY: tl.constexpr):
    """Over every peer's rows of this program in this rank's buffer half ``own``, chunk by chunk:
    wait until each has landed (`_wait_until_written`), or with EMPTY empty it (`_empty`)."""
    for row in range(pid, M, programs):
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = cols < N
            for peer in tl.static_range(WORLD):
                if peer != RANK:
                    chunk = own + peer * rank_stride + row * N + cols
                    if EMPTY:
                        _empty(chunk, mask, BITS)
                    else:
                        _wait_until_written(chunk, mask, BITS)


@triton.jit
def push_row(y, cols, mask, BufferPtrs, Epochs, rank_stride, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Store columns ``cols`` of row 0 of this rank's addend (``y``, in the buffers' dtype) into
    every peer's buffer, where the fused kernel's next one-way call (``pushed=True``) reads them:
    what its step 1 would store (NaNs as the canonical one). A one-row producer's epilogue."""
    epoch = tl.load(Epochs) + 1                        # program 0's next epoch: row 0 is its
    _push_chunk(y, cols, mask, BufferPtrs, (epoch % 2) * WORLD * rank_stride, rank_stride, RANK, WORLD, True)


@triton.jit
def _push_chunk(a, offsets, mask, BufferPtrs, half, rank_stride, RANK: tl.constexpr, WORLD: tl.constexpr,
                ONE_WAY: tl.constexpr):
    """Step 1 for one chunk of this rank's addend: store ``a`` at ``offsets`` of this rank's region
    of every peer's buffer half; one-way, every NaN as the canonical one (never the "empty" bits)."""
    if ONE_WAY:
        a = tl.where(a != a, float("nan"), a)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            buffer = tl.load(BufferPtrs + peer).to(tl.pointer_type(a.dtype))
            tl.store(buffer + half + RANK * rank_stride + offsets, a, mask=mask)


@dataclass(frozen=True)
class PushTarget:
    """Where a one-row producer stores its output for the fused kernel (`push_row`): the one-way
    buffers (``buffer_ptrs``), this rank's epochs, its rank and the region size in elements."""
    buffer_ptrs: torch.Tensor
    epochs: torch.Tensor
    rank: int
    rank_stride: int

    def kernel_args(self) -> tuple:
        return self.buffer_ptrs, self.epochs, self.rank_stride

    def constexprs(self) -> dict:
        return {"RANK": self.rank, "WORLD": self.buffer_ptrs.numel()}


@triton.jit
def _bits_pointer(ptr, BITS: tl.constexpr):
    """``ptr`` as a pointer to integers of its elements' width (16 or 32 bits)."""
    if BITS == 16:
        return ptr.to(tl.pointer_type(tl.int16))
    else:
        return ptr.to(tl.pointer_type(tl.int32))


@triton.jit
def _wait_until_written(ptr, mask, BITS: tl.constexpr):
    """Spin until no element of the chunk at ``ptr`` holds the "empty" bits (all ones): volatile
    loads, past this SM's L1, until a peer's stores have landed in every one."""
    bits = _bits_pointer(ptr, BITS)
    pending = 1
    while pending > 0:   # a scalar carried round the loop (a block of them fails Triton 3.7's layout pass)
        pending = tl.max((tl.load(bits, mask=mask, other=0, volatile=True) == -1).to(tl.int32), 0)


@triton.jit
def _empty(ptr, mask, BITS: tl.constexpr):
    """Store the "empty" bits (all ones) into the chunk at ``ptr``."""
    bits = _bits_pointer(ptr, BITS)
    tl.store(bits, tl.full(ptr.shape, -1, bits.dtype.element_ty), mask=mask)


@triton.jit
def _signal_and_wait(FlagPtrs, epoch, pid, RANK: tl.constexpr, WORLD: tl.constexpr, WORLD_POW2: tl.constexpr,
                     SPIN_ASM: tl.constexpr):
    """2. and 3. of the module's docstring: signal every peer's flag for (this program, this rank),
    then wait for every peer's flag for this program in this rank's flags to reach ``epoch``."""
    # Every thread's stores before come before the flags (the barrier orders them, the release
    # makes them visible first). One thread per peer, all peers at once: one after another, each
    # release waits for the one before to land (about a microsecond a peer over NVLink).
    tl.debug_barrier()
    peers = tl.arange(0, WORLD_POW2)
    others = (peers < WORLD) & (peers != RANK)
    peer_flags = tl.load(FlagPtrs + peers, mask=others, other=0).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(peer_flags + pid * WORLD + RANK, tl.full([WORLD_POW2], 0, tl.int64) + epoch, mask=others,
                   sem="release", scope="sys")
    # 3. wait for every peer's rows of this program: again one thread per peer
    own_flags = tl.load(FlagPtrs + RANK)
    if SPIN_ASM:
        # Each thread spins on its peer's flag with acquiring loads (no read-modify-write); a lane
        # with no peer waits for -1, which every flag has passed.
        wanted = tl.where(others, epoch, -1)
        tl.inline_asm_elementwise(
            """{
            .reg .pred %p<1>;
            .reg .s64 %v<1>;
            spin:
            ld.acquire.sys.global.s64 %v0, [$1];
            setp.lt.s64 %p0, %v0, $2;
            @%p0 bra spin;
            mov.u32 $0, 0;
            }""",
            "=r,l,l", [own_flags + (pid * WORLD + peers) * 8, wanted], dtype=tl.int32, is_pure=False, pack=1)
    else:   # Triton's interpreter runs no PTX: one peer after another, with acquiring atomics
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                flag = own_flags.to(tl.pointer_type(tl.int64)) + pid * WORLD + peer
                while tl.atomic_add(flag, 0, sem="acquire", scope="sys") < epoch:
                    pass


@triton.jit
def _sum_in_rank_order(addend_row, buffer_row, rank_stride, cols, mask, RANK: tl.constexpr, WORLD: tl.constexpr):
    """The ranks' addends of one row chunk summed in rank order, rounded to their dtype after each
    addition: this rank's from its input, the others' from its own buffer (``buffer_row``: the row
    in rank 0's region of this epoch's half)."""
    dtype = addend_row.dtype.element_ty
    for peer in tl.static_range(WORLD):
        if peer == RANK:
            a = tl.load(addend_row + cols, mask=mask, other=0.0)
        else:   # written by the peer: not through this SM's L1, which may hold an old epoch's
            a = tl.load(buffer_row + peer * rank_stride + cols, mask=mask, other=0.0, cache_modifier=".cv")
        if peer == 0:
            total = a
        else:
            total = (total.to(tl.float32) + a.to(tl.float32)).to(dtype)
    return total


def all_reduce_add_rmsnorm_triton(addend: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                                  round_first: bool, buffer_ptrs: torch.Tensor, flag_ptrs: torch.Tensor | None,
                                  epochs: torch.Tensor, rank: int, rank_stride: int,
                                  delta_weight: torch.Tensor | None = None, pushed: bool = False) -> torch.Tensor:
    """``h += sum over ranks of addend`` in place, then RMSNorm of h (as `add_rmsnorm_forward`);
    returns the norm. Every rank of the group calls it with its own addend ``[M, N]``, at once.
    With ``delta_weight``, ``h += rmsnorm(sum, delta_weight)`` instead (Gemma 2's post-norms).

    ``buffer_ptrs`` / ``flag_ptrs``: int64 ``[world]``, every rank's symmetric buffer (``2 x world x
    rank_stride`` elements of h's dtype) and flags (``PROGRAMS x world`` int64, zero at start) as
    mapped in this process; ``flag_ptrs=None``: the one-way protocol, whose buffers start with
    every byte 0xFF and have no flags. ``epochs``: int64 ``[PROGRAMS]``, this rank's own, zero at
    start. ``M x N`` must fit ``rank_stride``. ``pushed`` (one-way, one row): every rank's producer
    has already stored its addend into its peers' buffers (`push_row`)."""
    n = h.shape[-1]
    h2, a2 = h.view(-1, n), addend.view(-1, n)
    assert a2.shape == h2.shape and a2.dtype == h2.dtype and h2.numel() <= rank_stride, (a2.shape, h2.shape)
    assert not pushed or (flag_ptrs is None and h2.shape[0] == 1), "a producer pushes one row, one-way"
    y = torch.empty_like(h2)
    block_n, num_warps = row_launch_config(n)
    world = buffer_ptrs.numel()
    _all_reduce_add_rmsnorm_kernel[(PROGRAMS,)](
        a2, h2, weight, weight if delta_weight is None else delta_weight, y, buffer_ptrs,
        buffer_ptrs if flag_ptrs is None else flag_ptrs, epochs, h2.shape[0], n, a2.stride(0), h2.stride(0),
        y.stride(0), rank_stride, eps, RANK=rank, WORLD=world, WORLD_POW2=next_pow2(world), BLOCK_N=block_n,
        ROUND_FIRST=round_first, NORM_DELTA=delta_weight is not None, ONE_WAY=flag_ptrs is None, PUSHED=pushed,
        BITS=8 * h2.element_size(), SPIN_ASM=h2.is_cuda, num_warps=num_warps, **pdl(h2),
    )
    return y.view(h.shape)


def all_reduce_add_rmsnorm_torch(addends: list[torch.Tensor], h: torch.Tensor, weight: torch.Tensor, eps: float,
                                 round_first: bool = True, delta_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin, given every rank's addend in rank order: their sum rounded to the dtype after
    each addition, then `add_rmsnorm_forward`'s residual add and norm (and delta norm)."""
    total = addends[0].clone()
    for a in addends[1:]:
        total += a
    return add_rmsnorm_forward_torch(h, total, weight, eps, round_first, delta_weight)
