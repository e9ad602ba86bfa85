"""destindex_copy_kv: Triton and twin scatter rows exactly where dest_loc says."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, DEVICES, KV_FP8, randn, rng

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


# -- a float8 pool (--kv-cache-dtype fp8): K heads / k_scale, V heads / v_scale --------------------
# Powers of two, so that values on the float8 grid times a scale are exact on their way back: Triton's
# interpreter converts to float8 as no GPU does (ties away from zero, and a rounding that carries
# into the exponent halves the value instead), so its stores are exact only on exact grid values.
FP8_STORE_SCALES = dict(k_scale=2.0 ** -4, v_scale=2.0 ** -5)


def on_fp8_grid(g: torch.Generator, n: int, H: int, D: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """K and V rows (H // 2 heads each) whose values / their scale lie on the float8 grid, and a
    few that exceed e4m3's range once scaled (stored clamped to +-448)."""
    grid = (torch.randn(n, H, D, generator=g) * 40).to(KV_FP8).float()
    grid[:, :, 0] = 1000.0
    grid[:, :, 1] = -3000.0
    scale = torch.tensor([FP8_STORE_SCALES["k_scale"]] * (H // 2) + [FP8_STORE_SCALES["v_scale"]] * (H - H // 2))
    return (grid * scale[:, None]).to(dtype=dtype, device=device)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("fn", [destindex_copy_kv_torch, destindex_copy_kv_triton], ids=["torch", "triton"])
def test_fp8_store(fn, device, dtype):
    """K heads stored / k_scale, V heads / v_scale, clamped; only the given slots change."""
    g = rng(11)
    n, H, D, slots = 9, 4, 64, 30
    src = on_fp8_grid(g, n, H, D, dtype, device)
    dest = torch.zeros(slots, H, D, dtype=KV_FP8, device=device)
    loc = torch.randperm(slots, generator=g)[:n].to(device)
    fn(src, loc, dest, **FP8_STORE_SCALES)
    scale = torch.tensor([2.0 ** -4] * 2 + [2.0 ** -5] * 2, dtype=torch.float64, device=device)[None, :, None]
    want = (src.double() / scale).clamp(-448, 448)
    got = dest[loc.long()].double()
    assert got[:, :, 0].eq(448).all() and got[:, :, 1].eq(-448).all()
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -4)   # src's own rounding (fp16) at most
    unwritten = torch.ones(slots, dtype=torch.bool, device=device)
    unwritten[loc.long()] = False
    assert dest[unwritten].float().eq(0).all()


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_fp8_triton_is_the_twin(device, dtype):
    """Bitwise: on values of the float8 grid everywhere; on random values compiled only (both
    round to nearest even there; the interpreter does not, see FP8_STORE_SCALES)."""
    g = rng(12)
    n, H, D, slots = 7, 6, 32, 20
    loc = torch.randperm(slots, generator=g)[:n].to(device)
    sources = [on_fp8_grid(g, n, H, D, dtype, device)]
    if device == "cuda":
        sources.append(randn(g, n, H, D, dtype=dtype, device=device, scale=0.3))
    for src in sources:
        got, want = (torch.zeros(slots, H, D, dtype=KV_FP8, device=device) for _ in range(2))
        destindex_copy_kv_triton(src, loc, got, **FP8_STORE_SCALES)
        destindex_copy_kv_torch(src, loc, want, **FP8_STORE_SCALES)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_scales_need_a_float8_pool():
    dest = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="float8 only"):
        destindex_copy_kv_torch(torch.ones(1, 2, 8), torch.tensor([0]), dest, k_scale=0.5)
