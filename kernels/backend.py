"""Kernel backend selection: Triton kernels or their plain-torch twins.

`LLMSERVE_KERNEL_BACKEND` (read at call time, or overridden by `set_backend`):
  auto   (default) Triton iff the tensor is on CUDA, the torch twin otherwise;
  triton           always Triton (on CPU this needs Triton's interpreter, see below);
  torch            always the torch twin.

`LLMSERVE_PDL=0` turns programmatic dependent launch off (see `pdl`).

On CPU, Triton kernels run only in Triton's interpreter, which Triton chooses when
`@triton.jit` runs: `TRITON_INTERPRET=1` must be set before triton is first imported
(transformers, for one, imports it). `launcher` raises a clear error when it was not.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "LLMSERVE_KERNEL_BACKEND"

# log2(e): the attention kernels run their softmax on exp2, so scores and ALiBi slopes are scaled by it.
LOG2E = 1.4426950408889634

_override: str | None = None


def set_backend(name: str | None) -> None:
    """Force a backend for this process (`None` goes back to the environment variable)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}, expected one of {BACKENDS}")
    global _override
    _override = name


def get_backend() -> str:
    """The backend in force: `set_backend`'s choice, else the environment variable, else auto."""
    name = _override if _override is not None else os.environ.get(ENV_VAR, "auto").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={name!r}, expected one of {BACKENDS}")
    return name


def use_triton(t: torch.Tensor) -> bool:
    """True if the op on tensor `t` should run the Triton kernel rather than the torch twin."""
    name = get_backend()
    if name == "auto":
        return t.is_cuda
    return name == "triton"


def half_precision_on_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether our half-precision linear kernels (`gemv`, `skinny_gemm`) may compute x @ weight^T:
    fp16/bf16 operands of one dtype with unit-stride rows, on the Triton backend. fp32 stays with
    cuBLAS (the GPU's fp32 parity tests hold it to HF within 1e-4)."""
    return (x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.stride(1) == 1 and use_triton(x))


def launcher(kernel: Any, t: torch.Tensor) -> Any:
    """The `@triton.jit` kernel to launch for tensors on `t`'s device: `kernel` itself.

    CUDA tensors run it as Triton made it. CPU tensors need Triton's interpreter, which Triton
    picks when `@triton.jit` runs, from TRITON_INTERPRET at import: a kernel made without it
    cannot run on CPU, so say so rather than fail somewhere inside Triton.
    """
    if not t.is_cuda and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton kernels on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (or use LLMSERVE_KERNEL_BACKEND=torch)"
        )
    return kernel


PDL_ENV_VAR = "LLMSERVE_PDL"


@functools.cache
def _pdl_device(index: int) -> bool:
    # NVIDIA's griddepcontrol (sm_90 on); a ROCm build's "CUDA" devices have none
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def pdl(t: torch.Tensor) -> dict[str, bool]:
    """The launch arguments that run a kernel with programmatic dependent launch (PDL) where it
    exists: ``launch_pdl`` and the kernel's ``PDL`` constexpr, which makes it call `pdl_wait`
    (kernels/triton_math.py). Pass them to every launch of a kernel that takes ``PDL``.

    A decode step is a few hundred short dependent kernels, and each normally starts only once
    the one before has ended and flushed its writes. With PDL (Hopper on, CUDA tensors,
    ``LLMSERVE_PDL`` not ``0``) a kernel is launched while the one before still runs, and its
    programs wait (`pdl_wait`) before they touch memory an earlier kernel may write; a GEMV
    reads its first weight tile during the wait. `benchmarks/pdl.py` on an H200, CUDA graphs:
    600 tiny kernels 1.19 -> 0.93 ms, Llama-3-8B's 32 layers of GEMVs and norms at one row
    3.79 -> 3.61 ms (0.93 us a launch); the whole 8B step at batch 1 (`offline.py`) 4.43 ->
    4.24 ms."""
    on = (t.is_cuda and os.environ.get(PDL_ENV_VAR, "1").strip() != "0"
          and _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (block sizes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def vector_width(x: torch.Tensor, block_k: int) -> int:
    """Elements of x's dtype in one 16-byte load (8 in half precision, 4 in float32): the group a
    thread holds of a chunk's columns, which the kernels that sum a chunk group by group sum
    first, in registers."""
    return min(block_k, 16 // x.element_size())


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for operands upcast from `dtype`.

    fp16/bf16 values are exact in tf32, so tensor cores lose nothing; real fp32 data
    needs full IEEE products to stay within fp32 tolerances.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def softmax_scale(sm_scale: float | None, head_dim: int) -> float:
    """The attention ops' score scale: ``sm_scale``, or head_dim**-0.5 when it is None (HF's
    ``scaling``; 1/sqrt(head_dim) is a different double for head_dim 32, 96 or 128)."""
    return head_dim ** -0.5 if sm_scale is None else sm_scale


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Causal attention of one request's new queries q ``[n, Hq, D]`` over its keys and values
    k, v ``[L, Hkv, D]`` (the n new tokens last), through torch's SDPA called as HF's "sdpa"
    attention calls it. The attention twins use this so that half precision on CPU rounds as HF
    does: SDPA's CPU kernel rounds the probabilities to q's dtype before the product with V, an
    fp32 softmax @ V does not, and the two differ by a unit in the last place on about a quarter
    of the outputs (SmolLM2's first layer). Returns ``[n, Hq, D]`` in q's dtype."""
    n, L = q.shape[0], k.shape[0]
    mask = None
    if 1 < n < L:  # new tokens after a cached prefix: the causal mask is aligned bottom-right
        pos = torch.arange(L, device=q.device)
        mask = pos[None, :] <= pos[L - n:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=n > 1 and mask is None, scale=sm_scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                     sliding_window: int = 0, logit_softcap: float = 0.0) -> torch.Tensor:
    """`sdpa_attention` with a sliding window (key j visible to query p iff p - W < j <= p) and
    score soft-capping, written op for op as HF's "eager" attention (Gemma 2 runs that one: SDPA
    has no soft-capping): scores in q's dtype, capped, masked, softmax in fp32 rounded back to q's
    dtype, then @ V. The n queries are the last n of the L keys' positions. Returns ``[n, Hq, D]``."""
    n, L, Hq, Hkv = q.shape[0], k.shape[0], q.shape[1], k.shape[1]
    qh = q.transpose(0, 1)                                               # [Hq, n, D]
    kh = k.transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)          # [Hq, L, D]
    vh = v.transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * sm_scale
    if logit_softcap:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    key_pos = torch.arange(L, device=q.device)
    q_pos = key_pos[L - n:, None]
    visible = key_pos[None, :] <= q_pos
    if sliding_window:
        visible &= key_pos[None, :] > q_pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype,
              scales: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows ``slots`` of a KV pool, in ``dtype``: the attention twins' gather. A float8
    pool's rows are dequantized (stored value * its tensor's scale, in fp32, rounded once)."""
    # index_select, not k_cache[slots]: the same copy, faster on a CPU (SmolLM2's 3 x 64 at 700
    # slots: 67 against 50 us inside a decode step, whose 30 layers gather 60 times).
    if k_cache.dtype == dtype:
        return k_cache.index_select(0, slots), v_cache.index_select(0, slots)
    k, v = (_select_rows(c, slots) for c in (k_cache, v_cache))
    return (k.float() * scales[0]).to(dtype), (v.float() * scales[1]).to(dtype)


def _select_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``pool.index_select(0, slots)``; a one-byte (float8) pool's rows as bytes: not every
    device's index_select takes float8."""
    if pool.element_size() != 1:
        return pool.index_select(0, slots)
    return pool.view(torch.uint8).index_select(0, slots).view(pool.dtype)


def gather_padded_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, req_rows: torch.Tensor,
    kv_lens: torch.Tensor, L: int, dtype: torch.dtype, scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """K and V ``[bs, L, Hkv, D]`` of each request's first ``kv_lens[i]`` positions, padded to L,
    and the ``[bs, L]`` mask of real positions (None when no request is padded): what the
    attention twins' batched paths hand to one SDPA call (in ``dtype``, as `gather_kv`).

    Padding positions may hold any slot value in req_to_token, so they read slot 0; and slot 0
    may hold anything (a never-written slot may be NaN), which a mask does not keep out: SDPA
    adds -inf to its score (NaN + -inf is NaN) and multiplies its probability 0 by its V row
    (0 * NaN is NaN). So the padding rows are zeroed (those rows only, in place)."""
    bs, Hkv, D = req_rows.shape[0], k_cache.shape[1], k_cache.shape[2]
    valid = torch.arange(L, device=req_to_token.device)[None, :] < kv_lens[:, None]
    slots = req_to_token[req_rows, :L].masked_fill(~valid, 0).reshape(-1)
    k, v = gather_kv(k_cache, v_cache, slots, dtype, scales)  # [bs * L, Hkv, D]
    pad = (~valid).reshape(-1).nonzero().squeeze(1)
    if pad.numel():
        k.index_fill_(0, pad, 0)
        v.index_fill_(0, pad, 0)
    return k.view(bs, L, Hkv, D), v.view(bs, L, Hkv, D), valid if pad.numel() else None


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, last_dim]`` tensor whose rows are unit-stride (a view when possible),
    the layout the row-wise kernels (norms, silu_and_mul) read."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def row_launch_config(n: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for a kernel that handles one row of ``n`` elements per program."""
    block = min(next_pow2(n), 4096)
    return block, 4 if block <= 1024 else 8


def launch_row_norm(kernel: Any, x: torch.Tensor, params: Sequence[torch.Tensor], eps: float,
                    **constexprs: Any) -> torch.Tensor:
    """Run a row-wise norm ``kernel(X, *params, Y, stride_x, stride_y, N, eps, BLOCK_N=..., PDL=...,
    **constexprs)``, one program per row of ``x`` (any leading dims); returns the new output, shaped
    like ``x``."""
    x2 = as_rows(x)
    y = torch.empty_like(x2)
    if x2.shape[0] > 0:
        block_n, num_warps = row_launch_config(x2.shape[1])
        launcher(kernel, x2)[(x2.shape[0],)](
            x2, *params, y, x2.stride(0), y.stride(0), x2.shape[1], eps,
            BLOCK_N=block_n, num_warps=num_warps, **constexprs, **pdl(x2),
        )
    return y.view(x.shape)
