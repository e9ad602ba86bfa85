"""destindex_copy_kv: Triton and twin scatter rows exactly where dest_loc says."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, DEVICES, randn, rng

from llmserve.kernels.destindex_copy_kv import destindex_copy_kv_torch, destindex_copy_kv_triton


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("fn", [destindex_copy_kv_torch, destindex_copy_kv_triton], ids=["torch", "triton"])
@pytest.mark.parametrize("n,H,D", [(1, 1, 64), (7, 2, 128), (33, 3, 32)])
def test_copy(fn, device, dtype, index_dtype, n, H, D):
    g = rng(n)
    slots = 2 * n + 5
    src = randn(g, n, H, D, dtype=dtype, device=device)
    dest = randn(g, slots, H, D, dtype=dtype, device=device)
    loc = torch.randperm(slots, generator=g)[:n]
    want = dest.clone()
    for i, s in enumerate(loc.tolist()):  # plain loop: the independent reference
        want[s] = src[i]
    fn(src, loc.to(device=device, dtype=index_dtype), dest)
    torch.testing.assert_close(dest, want, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_from_strided_source(device):
    """K (or V) is often a view of a fused qkv projection, not a contiguous tensor."""
    g = rng(5)
    qkv = randn(g, 9, 3, 2, 32, dtype=torch.float16, device=device)
    src = qkv[:, 1]  # [9, 2, 32], non-contiguous
    dest = randn(g, 20, 2, 32, dtype=torch.float16, device=device)
    loc = torch.randperm(20, generator=g)[:9].to(device=device, dtype=torch.int32)
    want = dest.clone()
    destindex_copy_kv_torch(src, loc, want)
    assert not torch.equal(want, dest)
    destindex_copy_kv_triton(src, loc, dest)
    torch.testing.assert_close(dest, want, atol=0, rtol=0)
