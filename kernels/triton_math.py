"""Small ``@triton.jit`` helpers shared by several kernels (functions Triton's ``tl.math`` lacks)."""

from __future__ import annotations

import triton
import triton.language as tl

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
def row_chunk(w_ptrs, X, k0, K, offs_k, row_mask, EVEN_K: tl.constexpr, FIRST: tl.constexpr = False):
    """Chunk ``k0`` of a one-row GEMV's loop over K: the weight tile ``w_ptrs + k0`` (``[rows,
    BLOCK_K]``, the rows past ``row_mask`` off) and x's columns, zeros past K (a chunk past K moves
    no memory). EVEN_K (the chunk width divides K): one condition a chunk, not one a column; none
    for the FIRST (k0 = 0), which is in K (the condition cost the dense GEMV 8 registers on sm_90)."""
    if EVEN_K and FIRST:
        w = tl.load(w_ptrs + k0, mask=row_mask[:, None], other=0.0)
        x = tl.load(X + k0 + offs_k)
    elif EVEN_K:
        w = tl.load(w_ptrs + k0, mask=row_mask[:, None] & (k0 < K), other=0.0)
        x = tl.load(X + k0 + offs_k, mask=k0 < K, other=0.0)
    else:
        k_mask = (k0 + offs_k) < K
        w = tl.load(w_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(X + k0 + offs_k, mask=k_mask, other=0.0)
    return w, x
