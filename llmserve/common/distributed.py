"""Tensor-parallel collectives. Every helper is a no-op at world size 1, so model code calls
them unconditionally and single-rank runs never touch torch.distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` across ranks in place (row-parallel matmul outputs, vocab-parallel embeddings)."""
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_last_dim(t: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's `t` along the last dimension (vocab-parallel logits)."""
    n = world_size()
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)


def init_distributed(rank: int, world: int, init_method: str, device: torch.device) -> None:
    """Join the process group: NCCL between GPUs, gloo between CPU processes."""
    if world == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
