"""rotary_emb_copy_kv: bitwise the two-kernel path (rotary_emb_fwd, then destindex_copy_kv)."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import CUDA, cos_sin, cpu_triton, randn, rng, tol

from llmserve.kernels.destindex_copy_kv import destindex_copy_kv_torch, destindex_copy_kv_triton
from llmserve.kernels.qk_rmsnorm import QKNorm, qk_rmsnorm_torch_, qk_rmsnorm_triton_
from llmserve.kernels.rotary_emb import rotary_emb_fwd_torch, rotary_emb_fwd_triton
from llmserve.kernels.rotary_emb_copy_kv import rotary_emb_copy_kv_torch, rotary_emb_copy_kv_triton

# (n, Hq, Hkv, D): odd head counts, more kv heads than one program's block, n = 0 and 1.
SHAPES = [(0, 4, 2, 64), (1, 4, 2, 64), (1, 5, 1, 32), (7, 3, 3, 128), (5, 9, 17, 32), (9, 32, 8, 64)]

# Triton's interpreter runs bf16 too: both paths there round through the same emulation.
DEVICE_DTYPES = [
    pytest.param(dev, dt, id=f"{dev}-{str(dt).removeprefix('torch.')}", marks=[cpu_triton] if dev == "cpu" else [])
    for dev in ["cpu"] + (["cuda"] if CUDA else [])
    for dt in (torch.float32, torch.float16, torch.bfloat16)
]


def layer_inputs(n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str, index_dtype: torch.dtype,
                 seed: int = 0):
    """q and kv as the Llama layer splits them from one flat qkv projection (with n == 1 that
    view gives the size-1 dimension odd strides), cos/sin, KV slots and a random cache."""
    g = rng(seed)
    qkv = randn(g, n, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    q = qkv[:, : hq * d].view(-1, hq, d)
    kv = qkv[:, hq * d:].view(-1, 2 * hkv, d)
    cos, sin = cos_sin(g, n, d, device)
    slots = 2 * n + 5
    dest_loc = torch.randperm(slots, generator=g)[:n].to(device=device, dtype=index_dtype)
    cache = randn(g, slots, 2 * hkv, d, dtype=dtype, device=device)
    return qkv, q, kv, cos, sin, dest_loc, cache


def two_kernels(rotary, copy, q, kv, cos, sin, dest_loc, cache) -> None:
    rotary(q, kv[:, : kv.shape[1] // 2], cos, sin)
    copy(kv, dest_loc, cache)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,Hq,Hkv,D", SHAPES)
def test_triton_is_the_two_triton_kernels_bitwise(device, dtype, index_dtype, n, Hq, Hkv, D):
    qkv, q, kv, cos, sin, dest_loc, cache = layer_inputs(n, Hq, Hkv, D, dtype, device, index_dtype)
    want_qkv, want_cache, q0 = qkv.clone(), cache.clone(), q.clone()
    w_q, w_kv = want_qkv[:, : Hq * D].view(-1, Hq, D), want_qkv[:, Hq * D:].view(-1, 2 * Hkv, D)
    two_kernels(rotary_emb_fwd_triton, destindex_copy_kv_triton, w_q, w_kv, cos, sin, dest_loc, want_cache)
    rotary_emb_copy_kv_triton(q, kv, cos, sin, dest_loc, cache)
    assert n == 0 or not torch.equal(q, q0)
    assert torch.equal(q, w_q)                      # q rotated in place
    assert torch.equal(cache, want_cache)           # rotated K and plain V in their slots, nothing else
    assert torch.equal(kv[:, Hkv:], w_kv[:, Hkv:])  # V in the projection untouched


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_writes_rotated_k_not_the_projections_k(device, dtype):
    """The cache gets rotated K (not the projection's), and only the given slots change."""
    n, Hq, Hkv, D = 6, 4, 2, 64
    qkv, q, kv, cos, sin, dest_loc, cache = layer_inputs(n, Hq, Hkv, D, dtype, device, torch.int32, seed=3)
    before_kv, before_cache = kv.clone(), cache.clone()
    rotary_emb_copy_kv_triton(q, kv, cos, sin, dest_loc, cache)
    rows = dest_loc.long()
    assert not torch.equal(cache[rows, :Hkv], before_kv[:, :Hkv])   # k was rotated on its way in
    assert torch.equal(cache[rows, Hkv:], before_kv[:, Hkv:])
    others = torch.ones(cache.shape[0], dtype=torch.bool, device=device)
    others[rows] = False
    assert torch.equal(cache[others], before_cache[others])


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_twin_is_the_two_twins(dtype, index_dtype):
    qkv, q, kv, cos, sin, dest_loc, cache = layer_inputs(7, 3, 1, 64, dtype, "cpu", index_dtype, seed=1)
    want_qkv, want_cache = qkv.clone(), cache.clone()
    two_kernels(rotary_emb_fwd_torch, destindex_copy_kv_torch, want_qkv[:, : 3 * 64].view(-1, 3, 64),
                want_qkv[:, 3 * 64:].view(-1, 2, 64), cos, sin, dest_loc, want_cache)
    rotary_emb_copy_kv_torch(q, kv, cos, sin, dest_loc, cache)
    assert torch.equal(qkv, want_qkv) and torch.equal(cache, want_cache)


# -- a float8 cache (--kv-cache-dtype fp8): rotated K / k_scale, V / v_scale ------------------------
FP8_SCALES = dict(k_scale=0.05, v_scale=0.03)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,Hq,Hkv,D", [(7, 3, 3, 128), (5, 9, 17, 32)])
def test_fp8_cache_is_the_two_triton_kernels_bitwise(device, dtype, n, Hq, Hkv, D):
    qkv, q, kv, cos, sin, dest_loc, _ = layer_inputs(n, Hq, Hkv, D, dtype, device, torch.int32, seed=4)
    cache = torch.zeros(2 * n + 5, 2 * Hkv, D, dtype=torch.float8_e4m3fn, device=device)
    want_qkv, want_cache = qkv.clone(), cache.clone()
    w_q, w_kv = want_qkv[:, : Hq * D].view(-1, Hq, D), want_qkv[:, Hq * D:].view(-1, 2 * Hkv, D)
    rotary_emb_fwd_triton(w_q, w_kv[:, :Hkv], cos, sin)
    destindex_copy_kv_triton(w_kv, dest_loc, want_cache, **FP8_SCALES)
    rotary_emb_copy_kv_triton(q, kv, cos, sin, dest_loc, cache, **FP8_SCALES)
    assert torch.equal(q, w_q)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert cache.view(torch.uint8)[dest_loc.long()].ne(0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_twin_is_the_two_twins(dtype):
    qkv, q, kv, cos, sin, dest_loc, _ = layer_inputs(7, 3, 1, 64, dtype, "cpu", torch.int64, seed=5)
    cache = torch.zeros(19, 2, 64, dtype=torch.float8_e4m3fn)
    want_qkv, want_cache = qkv.clone(), cache.clone()
    w_kv = want_qkv[:, 3 * 64:].view(-1, 2, 64)
    rotary_emb_fwd_torch(want_qkv[:, : 3 * 64].view(-1, 3, 64), w_kv[:, :1], cos, sin)
    destindex_copy_kv_torch(w_kv, dest_loc, want_cache, **FP8_SCALES)
    rotary_emb_copy_kv_torch(q, kv, cos, sin, dest_loc, cache, **FP8_SCALES)
    assert torch.equal(qkv, want_qkv) and torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    # the stored values are the rotated K and V over their scales, to float8's rounding
    scale = torch.tensor([0.05, 0.03])[None, :, None]
    torch.testing.assert_close(cache[dest_loc].float() * scale, w_kv.float(), atol=1e-3, rtol=2 ** -4)


@pytest.mark.skipif(not CUDA, reason="the interpreter's float8 rounding is not a GPU's (test_destindex_copy_kv)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp8_triton_is_the_twin(dtype):
    qkv, q, kv, cos, sin, dest_loc, _ = layer_inputs(9, 32, 8, 128, dtype, "cuda", torch.int32, seed=6)
    caches = [torch.zeros(23, 16, 128, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2)]
    q2, kv2 = q.clone(), kv.clone()
    rotary_emb_copy_kv_triton(q, kv, cos, sin, dest_loc, caches[0], **FP8_SCALES)
    rotary_emb_copy_kv_torch(q2, kv2, cos, sin, dest_loc, caches[1], **FP8_SCALES)
    assert torch.equal(q, q2) and torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))


# -- q and k norms first (Qwen3, Gemma 3: qk_norm) ------------------------------------------------
def qk_norm(d: int, dtype: torch.dtype, device: str, round_first: bool) -> QKNorm:
    g = rng(d + 1)
    wq, wk = randn(g, d, dtype=dtype, device=device), randn(g, d, dtype=dtype, device=device)
    if not round_first:  # Gemma's weights: the fp32 1 + w
        wq, wk = 1.0 + wq.float(), 1.0 + wk.float()
    return QKNorm(wq, wk, 1e-6, round_first)


@pytest.mark.parametrize("round_first", [True, False], ids=["llama", "gemma"])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,Hq,Hkv,D", [(1, 4, 2, 64), (7, 3, 3, 128), (5, 9, 17, 32)])
def test_qk_norm_is_the_norm_then_rotary(device, dtype, round_first, n, Hq, Hkv, D):
    """With qk_norm: q and the cache as `qk_rmsnorm_` then the plain launch give them (within a
    unit in the last place: the sum of squares runs in another order), and V as it was."""
    norm = qk_norm(D, dtype, device, round_first)
    qkv, q, kv, cos, sin, dest_loc, cache = layer_inputs(n, Hq, Hkv, D, dtype, device, torch.int32, seed=7)
    want_qkv, want_cache = qkv.clone(), cache.clone()
    w_q, w_kv = want_qkv[:, : Hq * D].view(-1, Hq, D), want_qkv[:, Hq * D:].view(-1, 2 * Hkv, D)
    qk_rmsnorm_triton_(w_q, w_kv[:, :Hkv], norm.q_weight, norm.k_weight, norm.eps, round_first)
    rotary_emb_copy_kv_triton(w_q, w_kv, cos, sin, dest_loc, want_cache)
    rotary_emb_copy_kv_triton(q, kv, cos, sin, dest_loc, cache, qk_norm=norm)
    torch.testing.assert_close(q, w_q, **tol(dtype))
    torch.testing.assert_close(cache, want_cache, **tol(dtype))
    assert torch.equal(cache[dest_loc.long(), Hkv:], kv[:, Hkv:])     # V stored as it was


@pytest.mark.parametrize("round_first", [True, False], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qk_norm_twin_is_the_twins_in_order(dtype, round_first):
    norm = qk_norm(64, dtype, "cpu", round_first)
    qkv, q, kv, cos, sin, dest_loc, cache = layer_inputs(7, 3, 1, 64, dtype, "cpu", torch.int64, seed=8)
    want_qkv, want_cache = qkv.clone(), cache.clone()
    w_q, w_kv = want_qkv[:, : 3 * 64].view(-1, 3, 64), want_qkv[:, 3 * 64:].view(-1, 2, 64)
    qk_rmsnorm_torch_(w_q, w_kv[:, :1], norm.q_weight, norm.k_weight, norm.eps, round_first)
    two_kernels(rotary_emb_fwd_torch, destindex_copy_kv_torch, w_q, w_kv, cos, sin, dest_loc, want_cache)
    rotary_emb_copy_kv_torch(q, kv, cos, sin, dest_loc, cache, qk_norm=norm)
    assert torch.equal(qkv, want_qkv) and torch.equal(cache, want_cache)
