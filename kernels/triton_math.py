"""Small ``@triton.jit`` helpers shared by several kernels (functions Triton's ``tl.math`` lacks)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Under programmatic dependent launch (``PDL``, kernels/backend.py's `pdl`): wait until the
    kernel before has ended and its writes are visible, then let the next kernel launch.

    A PDL kernel calls this in every program before it reads anything an earlier kernel may have
    written, before it writes anything, and before any early return (a kernel whose programs all
    skipped the wait could end before the kernel before it). Reads before the wait see everything
    but the kernel before's writes (that kernel was let go only after its own wait): weights, and
    an adapter pool filled between steps, may be read there. The next launch is let go only after
    the wait, so at most one kernel waits ahead."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def tanh(x):
    """tanh(x) = 2 sigmoid(2x) - 1 through exp2 (fp32): exact at +-inf, about 1e-7 absolute error
    near 0. Triton 3.6/3.7 have no portable tanh (libdevice's is CUDA-only, not interpreted)."""
    return 2.0 / (1.0 + tl.math.exp2(-2.8853900817779268 * x)) - 1.0   # 2 log2(e) x


@triton.jit
def softcap(s, cap):
    """Logit soft-capping, ``cap * tanh(s / cap)`` (Gemma 2's attention and final logits)."""
    return cap * tanh(s / cap)


@triton.jit
def silu(g):
    """silu(g) = g sigmoid(g) (fp32): the SwiGLU MLPs' activation."""
    return g / (1.0 + tl.exp(-g))


@triton.jit
def gelu_tanh(g):
    """gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), computed as g sigmoid(2u)
    (the same value, without the cancellation of 1 + tanh(u) for very negative u): GeGLU's."""
    u = 0.7978845608028654 * (g + 0.044715 * g * g * g)     # sqrt(2 / pi) (g + 0.044715 g^3)
    return g / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def row_chunk(w_ptrs, X, k0, K, offs_k, row_mask, EVEN_K: tl.constexpr, FIRST: tl.constexpr = False,
              PDL: tl.constexpr = False):
    """Chunk ``k0`` of a one-row GEMV's loop over K: the weight tile ``w_ptrs + k0`` (``[rows,
    BLOCK_K]``, the rows past ``row_mask`` off) and x's columns, zeros past K (a chunk past K moves
    no memory). EVEN_K (the chunk width divides K): one condition a chunk, not one a column; none
    for the FIRST (k0 = 0), which is in K (the condition cost the dense GEMV 8 registers on sm_90).
    The FIRST chunk waits for the kernel before (`pdl_wait`) between its weight tile and x: the
    weights are read while that kernel ends."""
    if EVEN_K and FIRST:
        w = tl.load(w_ptrs + k0, mask=row_mask[:, None], other=0.0)
    elif EVEN_K:
        w = tl.load(w_ptrs + k0, mask=row_mask[:, None] & (k0 < K), other=0.0)
    else:
        w = tl.load(w_ptrs + k0, mask=row_mask[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
    if FIRST:
        pdl_wait(PDL)
    if EVEN_K and FIRST:
        x = tl.load(X + k0 + offs_k)
    elif EVEN_K:
        x = tl.load(X + k0 + offs_k, mask=k0 < K, other=0.0)
    else:
        x = tl.load(X + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0)
    return w, x
