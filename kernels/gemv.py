"""One-row linear layer, y = x @ W^T (+ bias), for batch-1 decode steps.

With one input row a linear layer is a stream over its weight: every element is read once and
used once. At that shape cuBLAS runs a split-K GEMV plus a reduce kernel that reads 2.0-2.85 TB/s
on an H100 (the smaller the matrix, the lower), while this kernel reads 2.6-3.15 TB/s. A batch-1
Llama-3-8B step reads its 15 GB of weights ~0.55 ms sooner: 5.08 instead of 5.63 ms of GEMVs
(`benchmarks/decode_linear.py`; table in benchmarks/README.md). From two rows on, tensor cores
pay: `skinny_gemm` takes 2 to 64 rows.

Program p owns BLOCK_N output features and walks the whole of K in BLOCK_K-wide chunks: each
iteration loads a [BLOCK_N, BLOCK_K] weight tile (16 KB in flight a program), the next chunk's
loads issued before this chunk's sums, and sums its products in registers, each thread its own
16-byte groups of columns (``VEC`` elements: 8 in half precision), into a [BLOCK_N, BLOCK_K / VEC]
fp32 accumulator, reduced across lanes once at the end. Summing a whole chunk as it arrives would
put a cross-lane reduction in the loop; keeping every product until the end (a full-tile
accumulator, as this kernel did up to the 2026-11-27 runs) costs a tile of registers more: at the
default tiles (sm_90, bf16, Triton 3.6 and 3.7) 79 registers a thread against 120, 6 programs an
SM against 4, so 1.5x the bytes in flight. An H200 streams about 1.4x an H100's bytes with the
same SMs, so it needs the more in flight (the GEMVs read ~90% of the copy bandwidth on an H100 but
~70% on an H200 in the 2026-11-27 runs). A single pass over K needs no second kernel and makes
every output feature's sum order independent of the grid.

`gemv_act_and_mul` is a gated MLP's first half at one row: the fused gate_up projection and the
activation, ``act(x W_gate^T) * (x W_up^T)``, in one launch instead of two. A program owns BLOCK_N
features of gate and the same of up, so it holds both halves of its outputs. With expert ids it
is `fused_moe`'s gate_up for a few tokens: output row p reads its expert's weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .all_reduce_add_rmsnorm import PushTarget, push_row
from .backend import half_precision_on_triton, launcher, next_pow2, pdl, use_triton, vector_width
from .gelu_and_mul import gelu_and_mul_fwd_torch
from .lora import RowLora, no_row_lora, row_lora_delta, row_lora_loads
from .silu_and_mul import silu_and_mul_fwd_torch
from .triton_math import gelu_tanh, pdl_wait, row_chunk, silu

# (BLOCK_N, largest BLOCK_K, num_warps), from the H100 sweep (`benchmarks/decode_linear.py --sweep`,
# Llama-3-8B's five weights in bf16): the best of 16 choices on four of them, within 1% on gate_up
# (swept with the full-tile accumulator, before the 16-byte-group sums).
#
# One tile for every weight shape and card, not tuned per shape. The one-row GEMVs used
# to time a few tiles per shape at start-up and keep the fastest, as the quantized linears do.
# Timed alone, the small tiles win: over copies of each weight in a CUDA graph (how
# `benchmarks/decode_linear.py` times them), Llama-3-8B's down read 28.6 us at 2 x 512 against
# 30.1 at TILES, and at tp=2 the GEMVs of a step summed to 1.85 ms against 2.05. Inside the step
# they lose: each GEMV there follows a short kernel, under PDL reads its first tile while that
# kernel runs, and a bigger tile reads more of its weight then. On an H200 (2026-11-28, offline.py,
# 8B, batch 1, CUDA graphs, calls alternated) the step took 4.34-4.51 ms with the tiles picked
# alone, 4.20 / 4.20 with TILES everywhere, and 4.17-4.22 with the start-up tuning as it was, whose
# event timer measured Python's launch (60-180 us for a 5 us GEMV) and so picked at random.
TILES = (4, 2048, 4)


@triton.jit
def _gemv_kernel(
    X, W, Bias, Y, N, K, stride_w_n,
    LoraS, LoraB, Scaling, SegStart, NUM_SLOTS, SPLIT1, SPLIT2, R_SUB, stride_bs, stride_bn,
    PushBuffers, PushEpochs, push_rank_stride,   # PUSH only: the fused all-reduce's one-way buffers
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, VEC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PUSH: tl.constexpr,
    RANK: tl.constexpr, WORLD: tl.constexpr, PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # int64: row * stride can pass 2**31 in a large LM head (256k rows x 8192 columns).
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_w_n + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    # Each chunk's loads go out before the previous chunk's sums (the chunk past K: all masked
    # off, no traffic): one burst of loads a chunk, which Triton 3.6's schedule otherwise splits
    # into two waits on memory.
    w, x = row_chunk(w_ptrs, X, 0, K, offs_k, n_mask, EVEN_K, FIRST=True, PDL=PDL)
    for k0 in range(BLOCK_K, K + BLOCK_K, BLOCK_K):
        w_next, x_next = row_chunk(w_ptrs, X, k0, K, offs_k, n_mask, EVEN_K)
        acc += tl.sum(tl.reshape(w.to(tl.float32) * x.to(tl.float32)[None, :], [BLOCK_N, BLOCK_K // VEC, VEC]), 2)
        w = w_next
        x = x_next
    if HAS_LORA:    # after the loop, so that the loop is the plain GEMV's (kernels/lora.py, 4.)
        proj = (offs_n >= SPLIT1).to(tl.int32) + (offs_n >= SPLIT2).to(tl.int32)
        lora_s, lora_b, lora_scaling = row_lora_loads(LoraS, LoraB, Scaling, SegStart, NUM_SLOTS, offs_n, proj,
                                                      n_mask, R_SUB, stride_bs, stride_bn, BLOCK_R, BLOCK_S)
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_LORA:    # as lora_add: the linear layer's output rounds, then the product adds to it
        y = y.to(Y.dtype.element_ty).to(tl.float32) + row_lora_delta(lora_s, lora_b, lora_scaling)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_mask)
    if PUSH:        # a row-parallel projection's addend, sent on to the fused all-reduce's peers
        push_row(y.to(Y.dtype.element_ty), offs_n, n_mask, PushBuffers, PushEpochs, push_rank_stride, RANK, WORLD)


@triton.jit
def _gemv_act_and_mul_kernel(
    X, W, Y, ExpertIds, I, K, ROWS_PER_X, stride_xm, stride_we, stride_wn,
    LoraS, LoraB, Scaling, SegStart, NUM_SLOTS, SPLIT1, SPLIT2, R_SUB, stride_bs, stride_bn,
    ACT: tl.constexpr, HAS_EXPERTS: tl.constexpr, HAS_LORA: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    # Y[r, n] = act(X[r // ROWS_PER_X] . W[n]) * (X[r // ROWS_PER_X] . W[I + n]) for the output row
    # r = program_id(0) and BLOCK_N features n; with HAS_EXPERTS, W is expert ExpertIds[r]'s.
    # With HAS_LORA (one row, no experts), gate and up each get the adapter's product first.
    # Each chunk's products are summed VEC at a time (a thread's own 16-byte vector, no shuffle)
    # into [BLOCK_N, BLOCK_K / VEC] accumulators: two tiles' loads in flight on about half the
    # registers of full-tile accumulators (72 against 128 at the default tiles in bf16), so about
    # twice the programs, and twice the bytes in flight, fit an SM.
    row = tl.program_id(0)
    x_row = X + (row // ROWS_PER_X).to(tl.int64) * stride_xm
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    pdl_wait(PDL)
    if HAS_EXPERTS:
        gate_ptrs += tl.load(ExpertIds + row).to(tl.int64) * stride_we
    up_ptrs = gate_ptrs + I * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            mask = n_mask[:, None]
            x = tl.load(x_row + k0 + offs_k)
        else:
            mask = n_mask[:, None] & ((k0 + offs_k) < K)[None, :]
            x = tl.load(x_row + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0)
        x = x.to(tl.float32)[None, :]
        gate = tl.load(gate_ptrs + k0, mask=mask, other=0.0).to(tl.float32) * x
        up = tl.load(up_ptrs + k0, mask=mask, other=0.0).to(tl.float32) * x
        acc_gate += tl.sum(tl.reshape(gate, [BLOCK_N, BLOCK_K // VEC, VEC]), 2)
        acc_up += tl.sum(tl.reshape(up, [BLOCK_N, BLOCK_K // VEC, VEC]), 2)
    if HAS_LORA:    # after the loop, as gemv's; gate is projection 0 (columns n), up 1 (columns I + n)
        zero = tl.zeros([BLOCK_N], tl.int32)
        gate_s, gate_b, lora_scaling = row_lora_loads(LoraS, LoraB, Scaling, SegStart, NUM_SLOTS, offs_n, zero,
                                                      n_mask, R_SUB, stride_bs, stride_bn, BLOCK_R, BLOCK_S)
        up_s, up_b, _ = row_lora_loads(LoraS, LoraB, Scaling, SegStart, NUM_SLOTS, I + offs_n, zero + 1,
                                       n_mask, R_SUB, stride_bs, stride_bn, BLOCK_R, BLOCK_S)
    # as HF: gate and up round to the dtype (a linear layer's outputs), the activation's output
    # rounds, then the product
    gate = tl.sum(acc_gate, 1).to(Y.dtype.element_ty).to(tl.float32)
    up = tl.sum(acc_up, 1).to(Y.dtype.element_ty).to(tl.float32)
    if HAS_LORA:    # as lora_add on gate_up: each adds its product and rounds again
        gate = (gate + row_lora_delta(gate_s, gate_b, lora_scaling)).to(Y.dtype.element_ty).to(tl.float32)
        up = (up + row_lora_delta(up_s, up_b, lora_scaling)).to(Y.dtype.element_ty).to(tl.float32)
    if ACT == "gelu_tanh":
        act = gelu_tanh(gate)
    else:
        act = silu(gate)
    act = act.to(Y.dtype.element_ty).to(tl.float32) * up
    tl.store(Y + row.to(tl.int64) * I + offs_n, act.to(Y.dtype.element_ty), mask=n_mask)


def _lora_args(lora: RowLora | None, t: torch.Tensor) -> tuple[tuple, dict]:
    """The kernels' LoRA arguments: ``lora``'s, or unread ones (HAS_LORA off compiles them out)."""
    if lora is None:
        return no_row_lora(t)
    return lora.kernel_args(), lora.constexprs()


def _push_args(push: PushTarget | None, t: torch.Tensor) -> tuple[tuple, dict]:
    """The GEMV's push arguments: ``push``'s, or unread ones (PUSH off compiles them out)."""
    if push is None:
        return (t, t, 0), {"PUSH": False, "RANK": 0, "WORLD": 1}
    return push.kernel_args(), {"PUSH": True, **push.constexprs()}


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                *, lora: RowLora | None = None, tiles: tuple[int, int, int] | None = None,
                push: PushTarget | None = None) -> torch.Tensor:
    """Triton version of `gemv`; `tiles` (BLOCK_N, largest BLOCK_K, num_warps) forces a tile (the
    benchmark's sweep), else `TILES` (not tuned per shape: see there). ``lora``:
    the row's adapter product for weight's output columns, added in the epilogue (what `lora_add`
    would add after it, without its launches). ``push``: the output is also stored into the fused
    all-reduce's peers' buffers (`all_reduce_add_rmsnorm.push_row`), for its next call with
    ``pushed=True``."""
    N, K = weight.shape
    assert x.numel() == K and x.is_contiguous() and weight.stride(1) == 1, "gemv takes one contiguous row"
    block_n, block_k, num_warps = gemv_tile(K, tiles or TILES)
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    lora_args, lora_constexprs = _lora_args(lora, weight)
    push_args, push_constexprs = _push_args(push, x)
    launcher(_gemv_kernel, x)[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, N, K, weight.stride(0), *lora_args, *push_args,
        HAS_BIAS=bias is not None, HAS_LORA=lora is not None, EVEN_K=K % block_k == 0, BLOCK_N=block_n,
        BLOCK_K=block_k, VEC=vector_width(x, block_k), num_warps=num_warps, num_stages=1, **lora_constexprs,
        **push_constexprs, **pdl(x),
    )
    return y


# gemv_act_and_mul's (BLOCK_N, largest BLOCK_K, num_warps): two weight tiles a chunk, so half
# TILES' widest chunk (the same bytes in flight a program, the same registers).
ACT_AND_MUL_TILES = (4, 1024, 4)
ACTIVATIONS = {"silu": silu_and_mul_fwd_torch, "gelu_tanh": gelu_and_mul_fwd_torch}  # the twins'

def gemv_tile(K: int, tiles: tuple[int, int, int]) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of ``tiles`` for a K: `gemv_block_k`'s chunk, and where that
    is narrower than the widest (a K like Gemma 2's 3584 = 7 x 512) up to 4x the rows a program,
    so that a program keeps the widest tile's bytes in flight. A feature's sum order does not
    depend on the rows a program takes."""
    block_n, largest, num_warps = tiles
    block_k = gemv_block_k(K, largest)
    return block_n * min(4, max(1, largest // block_k)), block_k, num_warps


def gemv_block_k(K: int, largest: int) -> int:
    """The widest power-of-two chunk up to ``largest`` that divides K (no masks in the loop), if
    one of 64 or more does (768 -> 256); else one that covers K, masked."""
    block = largest
    while block >= 64:
        if K % block == 0:
            return block
        block //= 2
    return min(largest, max(16, next_pow2(K)))


def gemv_act_and_mul_triton(x: torch.Tensor, weight: torch.Tensor, act: str, *,
                            expert_ids: torch.Tensor | None = None, rows_per_x: int = 1,
                            lora: RowLora | None = None,
                            tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Triton version of `gemv_act_and_mul`. With ``expert_ids`` ``[P]`` the weight is
    ``[E, 2I, K]`` and the output ``[P, I]``: row p through expert ``expert_ids[p]`` from x's row
    ``p // rows_per_x`` (x ``[n, K]``, unit-stride rows). ``lora`` (one row, no experts): the
    adapter product of gate and up (a group of two projections), added before the activation.
    `tiles` as `gemv_triton`'s (`ACT_AND_MUL_TILES` unless given)."""
    assert act in ACTIVATIONS, act
    assert lora is None or (expert_ids is None and len(lora.splits) == 2), "LoRA on one row's gate and up"
    I, K = weight.shape[-2] // 2, weight.shape[-1]
    assert weight.stride(-1) == 1 and x.stride(-1) == 1, "unit-stride rows"
    if expert_ids is None:
        assert x.numel() == K, "gemv_act_and_mul takes one row"
        y = torch.empty(*x.shape[:-1], I, dtype=x.dtype, device=x.device)
        rows, ids, stride_we = 1, x, 0    # ids: any pointer, never read
    else:
        rows, ids, stride_we = expert_ids.numel(), expert_ids, weight.stride(0)
        y = torch.empty(rows, I, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = gemv_tile(K, tiles or ACT_AND_MUL_TILES)
    lora_args, lora_constexprs = _lora_args(lora, weight)
    launcher(_gemv_act_and_mul_kernel, x)[(rows, triton.cdiv(I, block_n))](
        x, weight, y, ids, I, K, rows_per_x, x.stride(-2) if x.dim() > 1 else K, stride_we, weight.stride(-2),
        *lora_args, ACT=act, HAS_EXPERTS=expert_ids is not None, HAS_LORA=lora is not None,
        EVEN_K=K % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, VEC=vector_width(x, block_k),
        num_warps=num_warps, num_stages=1, **lora_constexprs, **pdl(x),
    )
    return y


def gemv_act_and_mul(x: torch.Tensor, weight: torch.Tensor, act: str, lora: RowLora | None = None) -> torch.Tensor:
    """``act(gate) * up`` of the one-row linear layer ``x @ weight^T`` (x ``[..., K]``, leading dims
    of size 1; weight ``[2I, K]``: gate's rows, then up's), act ``"silu"`` (SwiGLU) or
    ``"gelu_tanh"`` (GeGLU): what `linear` then `silu_and_mul_fwd` / `gelu_and_mul_fwd` give,
    in one launch. ``lora`` (Triton only: `LoraBatch.row`): an adapter's product added to gate and
    up first. Returns a new ``[..., I]`` tensor in x's dtype."""
    if use_triton(x):
        return gemv_act_and_mul_triton(x, weight, act, lora=lora)
    assert lora is None, "the twins add adapters with lora_add"
    return ACTIVATIONS[act](F.linear(x, weight))


def gemv_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of `gemv`: the linear layer itself."""
    return F.linear(x, weight, bias)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` should run x @ weight^T here: a dense weight and one contiguous row that
    our half-precision kernels may take (`half_precision_on_triton`); two rows or more are `skinny_gemm`'s or cuBLAS's."""
    return (isinstance(weight, torch.Tensor) and x.numel() == x.shape[-1] and x.is_contiguous()
            and half_precision_on_triton(x, weight))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T + bias for x of one row ``[..., K]`` (leading dims of size 1), weight ``[N, K]``."""
    if use_triton(x):
        return gemv_triton(x, weight, bias)
    return gemv_torch(x, weight, bias)
