"""A mixture-of-experts router's top-k, as HF's ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``:
softmax over every expert's logit in float32, the k largest probabilities, and (Mixtral; Qwen-MoE
when ``norm_topk_prob``) those k rescaled to sum to 1.

One launch instead of torch's five (softmax, topk, sum, divide, the ids' cast): a decode step
runs this in every layer, where each launch costs about as much as its work."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launcher, next_pow2, pdl, use_triton
from .triton_math import pdl_wait


@triton.jit
def _moe_route_kernel(Logits, Weights, Ids, n, E, stride_l, TOP_K: tl.constexpr, K_P2: tl.constexpr,
                      RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, E_P2: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, E_P2)
    slots = tl.arange(0, K_P2)
    row_mask = rows < n
    logits = tl.load(Logits + rows.to(tl.int64)[:, None] * stride_l + experts[None, :],
                     mask=row_mask[:, None] & (experts < E)[None, :], other=float("-inf")).to(tl.float32)
    logits = tl.where(row_mask[:, None], logits, 0.0)  # rows past n: finite, never stored
    z = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = z / tl.sum(z, axis=1)[:, None]
    weights = tl.zeros([BLOCK_T, K_P2], tl.float32)
    ids = tl.zeros([BLOCK_T, K_P2], tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        # the lowest expert index among equal probabilities
        pick = tl.min(tl.where(probs == best[:, None], experts[None, :], E_P2), axis=1)
        weights = tl.where(slots[None, :] == slot, best[:, None], weights)
        ids = tl.where(slots[None, :] == slot, pick[:, None], ids)
        probs = tl.where(experts[None, :] == pick[:, None], -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    out = rows[:, None] * TOP_K + slots[None, :]
    mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    tl.store(Weights + out, weights, mask=mask)
    tl.store(Ids + out, ids, mask=mask)


def select_experts_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `select_experts` (its ids are int32)."""
    n, E = router_logits.shape
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty((n, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n, top_k), dtype=torch.int32, device=logits.device)
    if n:
        E_P2 = next_pow2(E)
        # A decode step's few rows take a tile of their own size (at least two rows: no one-row
        # blocks for the GPU compiler) and as few warps as hold it: its top-k is TOP_K rounds of
        # row reductions, which stay within a warp's shuffles when one warp holds the tile.
        BLOCK_T = max(2, min(64, max(16, 4096 // E_P2), next_pow2(n)))
        num_warps = max(1, min(4, BLOCK_T * E_P2 // 512))
        launcher(_moe_route_kernel, logits)[(triton.cdiv(n, BLOCK_T),)](
            logits, weights, ids, n, E, logits.stride(0), TOP_K=top_k, K_P2=next_pow2(top_k), RENORMALIZE=renormalize,
            BLOCK_T=BLOCK_T, E_P2=E_P2, num_warps=num_warps,
            **pdl(logits),
        )
    return weights, ids


def select_experts_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of `select_experts`, op for op as HF's routers (its ids are int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts from ``router_logits`` ``[n, E]``: float32 weights and integer
    expert ids, both ``[n, k]``, the largest weight first."""
    if use_triton(router_logits):
        return select_experts_triton(router_logits, top_k, renormalize)
    return select_experts_torch(router_logits, top_k, renormalize)
