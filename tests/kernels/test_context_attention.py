"""context_attention_fwd: Triton vs twin, twin vs SDPA on dense gathered K/V, and the twin's batched
fp32 path vs its per-request one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import (
    DEVICE_DTYPES, FP8_SCALES, alibi_slopes, i32, make_paged_kv, randn, rng, run_poisoned, tol, with_fp8_cache,
)

from llmserve.kernels import context_attention
from llmserve.kernels.context_attention import context_attention_fwd_torch, context_attention_fwd_triton

# (Hq, Hkv, D, cached_lens, q_lens, alibi)
CASES = [
    pytest.param(2, 2, 64, [0, 0, 0], [1, 7, 33], False, id="mha-d64-prefill"),
    pytest.param(4, 2, 128, [5, 0, 17], [7, 33, 1], False, id="gqa-d128-cached"),
    pytest.param(4, 2, 32, [3, 20], [16, 9], True, id="gqa-d32-cached-alibi"),
    pytest.param(2, 2, 64, [0, 31], [33, 2], True, id="mha-d64-alibi"),
    pytest.param(4, 1, 64, [40, 1], [3, 18], False, id="mqa-d64-verify"),
]


def make_inputs(seed: int, Hq: int, Hkv: int, D: int, cached: list[int], q_lens: list[int],
                alibi: bool, dtype: torch.dtype, device: str) -> dict:
    g = rng(seed)
    kv = make_paged_kv(g, [c + n for c, n in zip(cached, q_lens)], Hkv, D, dtype, device)
    total_q = sum(q_lens)
    # Requests' query rows are packed in an order different from the batch order.
    order = torch.randperm(len(q_lens), generator=g).tolist()
    q_start = [0] * len(q_lens)
    row = 0
    for i in order:
        q_start[i] = row
        row += q_lens[i]
    return dict(
        q=randn(g, total_q, Hq, D, dtype=dtype, device=device),
        k_cache=kv.k_cache, v_cache=kv.v_cache, req_to_token=kv.req_to_token, b_req_idx=kv.b_req_idx,
        b_q_start=i32(q_start, device), b_q_len=i32(q_lens, device), b_cached_len=i32(cached, device),
        max_q_len=max(q_lens), alibi_slopes=alibi_slopes(Hq, device) if alibi else None, _kv=kv,
    )


def sdpa_reference(inputs: dict, sm_scale: float | None = None) -> torch.Tensor:
    """Dense per-request attention through torch's SDPA with an explicit causal(+ALiBi) mask."""
    q, kv, slopes = inputs["q"], inputs["_kv"], inputs["alibi_slopes"]
    Hq = q.shape[1]
    out = torch.full_like(q, float("nan"), dtype=torch.float64)
    for i, (start, n, cached) in enumerate(zip(inputs["b_q_start"].tolist(), inputs["b_q_len"].tolist(),
                                                inputs["b_cached_len"].tolist())):
        k, v = kv.dense(i, Hq)  # [Hq, L, D]
        qi = q[start:start + n].double().transpose(0, 1)  # [Hq, n, D]
        rel = (torch.arange(cached + n, device=q.device)[None, :]
               - torch.arange(cached, cached + n, device=q.device)[:, None]).double()
        bias = torch.zeros(Hq, n, cached + n, dtype=torch.float64, device=q.device)
        if slopes is not None:
            bias = bias + slopes.double()[:, None, None] * rel
        bias = bias.masked_fill(rel > 0, float("-inf"))
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=bias, scale=sm_scale)
        out[start:start + n] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("Hq,Hkv,D,cached,q_lens,alibi", CASES)
def test_twin_matches_sdpa(Hq, Hkv, D, cached, q_lens, alibi):
    inputs = make_inputs(0, Hq, Hkv, D, cached, q_lens, alibi, torch.float32, "cpu")
    got = run_poisoned(context_attention_fwd_torch, inputs)
    torch.testing.assert_close(got.double(), sdpa_reference(inputs), atol=1e-5, rtol=1e-5)


def test_twin_sm_scale_and_longer_sequences():
    inputs = make_inputs(1, 8, 2, 64, [100, 0, 7], [60, 130, 1], True, torch.float32, "cpu")
    scale = 0.3 / math.sqrt(64)
    got = run_poisoned(context_attention_fwd_torch, inputs, sm_scale=scale)
    torch.testing.assert_close(got.double(), sdpa_reference(inputs, sm_scale=scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D,cached,q_lens,alibi", CASES)
def test_triton_matches_twin(device, dtype, Hq, Hkv, D, cached, q_lens, alibi):
    inputs = make_inputs(2, Hq, Hkv, D, cached, q_lens, alibi, dtype, device)
    want = run_poisoned(context_attention_fwd_torch, inputs)
    assert not want.isnan().any()
    # Small tiles: the short test sequences still span several query and key blocks.
    got = run_poisoned(context_attention_fwd_triton, inputs, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, **tol(dtype))


# The kernel's variants: query heads of a kv head packed into one tile (speculative verification,
# chunks), 64-bit row offsets, the (heads, requests, blocks) grid order; a negative scale (its
# sign goes into q); a head dim that is not a power of two (masked head-dim columns).
@pytest.mark.parametrize("options", [dict(pack_gqa=True), dict(pack_gqa=True, block_m=32), dict(offsets32=False),
                                     dict(req_major=False), dict(sm_scale=-0.1)],
                         ids=["pack", "pack-m32", "offsets64", "blocks-last", "negative-scale"])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_triton_variants(device, dtype, options):
    inputs = make_inputs(5, 8, 2, 64, [37, 0, 5], [3, 40, 17], True, dtype, device)
    want = run_poisoned(context_attention_fwd_torch, inputs, sm_scale=options.get("sm_scale"))
    got = run_poisoned(context_attention_fwd_triton, inputs, **{"block_m": 16, "block_n": 16, **options})
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_triton_head_dim_not_a_power_of_two(device, dtype):
    inputs = make_inputs(6, 4, 2, 80, [9, 0], [20, 33], False, dtype, device)
    want = run_poisoned(context_attention_fwd_torch, inputs)
    torch.testing.assert_close(run_poisoned(context_attention_fwd_triton, inputs, block_m=16, block_n=16), want, **tol(dtype))


# The wrapper picks 16-, 32- or 128-row query tiles from max_q_len: cover each.
@pytest.mark.parametrize("cached,q_lens", [([70, 5], [1, 4]), ([70, 0], [3, 40]), ([70, 0], [9, 150])],
                         ids=["tile16", "tile32", "tile128"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_triton_default_blocks_and_sm_scale(device, dtype, D, cached, q_lens):
    inputs = make_inputs(3, 4, 2, D, cached, q_lens, True, dtype, device)
    want = run_poisoned(context_attention_fwd_torch, inputs, sm_scale=0.05)
    got = run_poisoned(context_attention_fwd_triton, inputs, sm_scale=0.05)
    torch.testing.assert_close(got, want, **tol(dtype))


def test_alibi_and_cache_change_the_result():
    """Guards against vacuous passes: ALiBi and the cached prefix must both matter."""
    base = make_inputs(4, 2, 2, 32, [10], [5], False, torch.float32, "cpu")
    with_alibi = dict(base, alibi_slopes=alibi_slopes(2, "cpu"))
    no_cache = dict(base, b_cached_len=i32([0], "cpu"))
    o = run_poisoned(context_attention_fwd_torch, base)
    assert not torch.allclose(o, run_poisoned(context_attention_fwd_torch, with_alibi), atol=1e-3)
    assert not torch.allclose(o, run_poisoned(context_attention_fwd_torch, no_cache), atol=1e-3)


# -- the twin's batched fp32 path (one SDPA call for several requests) -----------------------------
def per_request(inputs: dict) -> torch.Tensor:
    """The twin called on one request at a time (its per-request path), into one NaN-poisoned output."""
    args = {k: v for k, v in inputs.items() if not k.startswith("_")}
    o = torch.full_like(args["q"], float("nan"))
    for i in range(args["b_req_idx"].shape[0]):
        one = dict(args, **{key: args[key][i:i + 1] for key in ("b_req_idx", "b_q_start", "b_q_len", "b_cached_len")})
        context_attention_fwd_torch(o=o, **dict(one, max_q_len=int(one["b_q_len"][0])))
    return o


@pytest.fixture
def batched_calls(monkeypatch) -> list:
    """Counts the twin's batched calls, so the tests below know which path they ran."""
    calls = []
    real = context_attention._batched_sdpa_context

    def spy(*args, **kw):
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(context_attention, "_batched_sdpa_context", spy)
    return calls


# (Hq, Hkv, D, cached_lens, q_lens); make_inputs packs the requests' rows in a shuffled order
BATCHED_CASES = [
    pytest.param(9, 3, 64, [0] * 4, [16] * 4, id="uniform-prefill"),
    pytest.param(4, 2, 32, [0, 0, 0], [5, 33, 1], id="uneven-prefill"),
    pytest.param(4, 2, 64, [10, 0, 3, 40], [7, 20, 1, 2], id="cached-prefixes"),
    pytest.param(4, 1, 64, [5, 0, 7], [0, 12, 3], id="mqa-empty-request"),
    pytest.param(2, 2, 16, [0, 5], [10, 5], id="same-kv-len-not-uniform"),
]


@pytest.mark.parametrize("Hq,Hkv,D,cached,q_lens", BATCHED_CASES)
def test_batched_twin_matches_per_request(batched_calls, Hq, Hkv, D, cached, q_lens):
    inputs = make_inputs(5, Hq, Hkv, D, cached, q_lens, False, torch.float32, "cpu")
    got = run_poisoned(context_attention_fwd_torch, inputs)
    assert len(batched_calls) == 1
    want = per_request(inputs)
    assert not want.isnan().any()
    # Padding can move a float32 rounding, nothing more.
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got.double(), sdpa_reference(inputs), atol=1e-5, rtol=1e-5)


def test_batched_twin_with_requests_in_batch_order(batched_calls):
    """Rows back to back in batch order (the model's prefill): q and o are used through views."""
    inputs = make_inputs(6, 9, 3, 64, [0] * 3, [8] * 3, False, torch.float32, "cpu")
    inputs["b_q_start"] = i32([0, 8, 16], "cpu")
    got = run_poisoned(context_attention_fwd_torch, inputs)
    assert len(batched_calls) == 1
    torch.testing.assert_close(got, per_request(inputs), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("cached,q_lens", [([0, 0, 0], [5, 33, 1]), ([10, 0, 3], [7, 20, 2])])
def test_batched_twin_never_reads_unwritten_slots(batched_calls, cached, q_lens):
    """Slots no request holds are NaN (as a never-written KV slot may be), slot 0 among them, and
    req_to_token points at them past every request's length: the padded gather must not let them
    through (slot 0 is what padding positions read)."""
    inputs = make_inputs(7, 4, 2, 32, cached, q_lens, False, torch.float32, "cpu")
    kv = inputs["_kv"]
    k_cache, v_cache, req_to_token = kv.k_cache.clone(), kv.v_cache.clone(), kv.req_to_token.clone()
    rows = kv.b_req_idx.long().tolist()
    held = torch.cat([req_to_token[r, :n].long() for r, n in zip(rows, kv.kv_lens)])
    if (held == 0).any():  # move the request holding slot 0 to an unused slot
        free = next(s for s in range(k_cache.shape[0]) if s not in set(held.tolist()))
        for r, n in zip(rows, kv.kv_lens):
            req_to_token[r, :n] = torch.where(req_to_token[r, :n] == 0, free, req_to_token[r, :n])
        k_cache[free], v_cache[free] = k_cache[0], v_cache[0]
        held = torch.cat([req_to_token[r, :n].long() for r, n in zip(rows, kv.kv_lens)])
    unused = torch.ones(k_cache.shape[0], dtype=torch.bool)
    unused[held] = False
    assert unused[0]
    k_cache[unused], v_cache[unused] = float("nan"), float("nan")
    nan_slots = unused.nonzero().squeeze(1).to(torch.int32)
    for r, n in zip(rows, kv.kv_lens):
        tail = req_to_token.shape[1] - n
        req_to_token[r, n:] = nan_slots[torch.arange(tail) % nan_slots.numel()]
    inputs.update(k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token)
    got = run_poisoned(context_attention_fwd_torch, inputs)
    assert len(batched_calls) == 1
    assert not got.isnan().any()
    torch.testing.assert_close(got, per_request(inputs), atol=2e-6, rtol=1e-5)


def test_one_long_request_keeps_the_batch_per_request(batched_calls):
    """Padding seven short requests to one long one would cost more than it saves."""
    cached, q_lens = [0, 0, 0, 0], [300, 2, 3, 1]
    assert not context_attention._padding_pays(q_lens, cached)
    assert context_attention._padding_pays([0] * 8, [64] * 8)
    inputs = make_inputs(8, 4, 2, 32, cached, q_lens, False, torch.float32, "cpu")
    got = run_poisoned(context_attention_fwd_torch, inputs)
    assert not batched_calls
    torch.testing.assert_close(got.double(), sdpa_reference(inputs), atol=1e-5, rtol=1e-5)


def test_half_precision_and_alibi_stay_per_request(batched_calls):
    for dtype, alibi in [(torch.float16, False), (torch.bfloat16, False), (torch.float32, True)]:
        inputs = make_inputs(9, 4, 2, 32, [0, 3], [6, 4], alibi, dtype, "cpu")
        run_poisoned(context_attention_fwd_torch, inputs)
    assert not batched_calls


# -- sliding windows and soft-capping (Gemma 2 / 3) --------------------------------------------------
def masked_reference(inputs: dict, window: int, softcap: float, sm_scale: float | None = None) -> torch.Tensor:
    """Dense fp64 attention with a sliding window (query p sees keys p - window < k <= p) and
    soft-capped scores, one request at a time: the independent reference of both twins."""
    q, kv = inputs["q"], inputs["_kv"]
    Hq, D = q.shape[1], q.shape[2]
    scale = D ** -0.5 if sm_scale is None else sm_scale
    out = torch.full_like(q, float("nan"), dtype=torch.float64)
    for i, (start, n, cached) in enumerate(zip(inputs["b_q_start"].tolist(), inputs["b_q_len"].tolist(),
                                                inputs["b_cached_len"].tolist())):
        k, v = kv.dense(i, Hq)
        scores = q[start:start + n].double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, n, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(cached, cached + n)[:, None]
        k_pos = torch.arange(cached + n)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:start + n] = (probs @ v).transpose(0, 1)
    return out


# (Hq, Hkv, D, cached_lens, q_lens, window, softcap): windows shorter than the context, over cached
# prefixes (chunked prefill) and within one prompt; a window of 1 (each query sees itself only)
MASK_CASES = [
    pytest.param(4, 2, 32, [0, 0], [40, 9], 8, 0.0, id="window-prefill"),
    pytest.param(4, 2, 64, [37, 70, 0], [20, 1, 50], 16, 0.0, id="window-cached"),
    pytest.param(2, 2, 32, [5, 0], [30, 41], 1, 0.0, id="window-1"),
    pytest.param(4, 1, 32, [33, 0], [17, 25], 0, 5.0, id="softcap"),
    pytest.param(8, 2, 64, [50, 3], [35, 60], 24, 3.0, id="window-softcap"),
    pytest.param(4, 2, 32, [3, 0], [10, 6], 64, 0.0, id="window-longer-than-context"),
]


@pytest.mark.parametrize("Hq,Hkv,D,cached,q_lens,window,softcap", MASK_CASES)
def test_twin_window_and_softcap(Hq, Hkv, D, cached, q_lens, window, softcap):
    inputs = make_inputs(11, Hq, Hkv, D, cached, q_lens, False, torch.float32, "cpu")
    got = run_poisoned(context_attention_fwd_torch, inputs, sliding_window=window, logit_softcap=softcap, sm_scale=0.2)
    want = masked_reference(inputs, window, softcap, sm_scale=0.2)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # guards against a vacuous pass: the mask and the cap change the output
    plain = run_poisoned(context_attention_fwd_torch, inputs, sm_scale=0.2)
    if window < max(c + n for c, n in zip(cached, q_lens)) or softcap:
        assert not torch.allclose(got, plain, atol=1e-3)


@pytest.mark.parametrize("options", [dict(block_m=16, block_n=16), dict(block_m=16, block_n=16, pack_gqa=True), {}],
                         ids=["tiles16", "pack", "default-tiles"])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D,cached,q_lens,window,softcap", MASK_CASES)
def test_triton_window_and_softcap(device, dtype, options, Hq, Hkv, D, cached, q_lens, window, softcap):
    inputs = make_inputs(12, Hq, Hkv, D, cached, q_lens, False, dtype, device)
    masks = dict(sliding_window=window, logit_softcap=softcap, sm_scale=0.2)
    want = run_poisoned(context_attention_fwd_torch, inputs, **masks)
    assert not want.isnan().any()
    got = run_poisoned(context_attention_fwd_triton, inputs, **masks, **options)
    torch.testing.assert_close(got, want, **tol(dtype))


# -- a float8 cache (--kv-cache-dtype fp8) -----------------------------------------------------------
# (Hq, Hkv, D, cached, q_lens, alibi, window, softcap): prefill and cached prefixes (the twin's
# batched and per-request paths), ALiBi, a window with soft-capping
FP8_CASES = [
    pytest.param(4, 2, 128, [5, 0, 17], [7, 33, 1], False, 0, 0.0, id="gqa-d128-cached"),
    pytest.param(4, 2, 32, [3, 20], [16, 9], True, 0, 0.0, id="gqa-d32-cached-alibi"),
    pytest.param(8, 2, 32, [30, 0], [9, 40], False, 16, 3.0, id="window-softcap"),
]


def fp8_inputs(seed: int, Hq, Hkv, D, cached, q_lens, alibi, window, softcap, dtype, device) -> tuple[dict, dict, dict]:
    """(the unquantized inputs, with their cache in float8, with that cache dequantized)"""
    inputs = dict(make_inputs(seed, Hq, Hkv, D, cached, q_lens, alibi, dtype, device), sliding_window=window,
                  logit_softcap=softcap)
    return inputs, *with_fp8_cache(inputs, **FP8_SCALES)


@pytest.mark.parametrize("Hq,Hkv,D,cached,q_lens,alibi,window,softcap", FP8_CASES)
def test_twin_fp8_cache_is_its_dequantized_values(Hq, Hkv, D, cached, q_lens, alibi, window, softcap):
    inputs, fp8, dequantized = fp8_inputs(20, Hq, Hkv, D, cached, q_lens, alibi, window, softcap, torch.float32, "cpu")
    want = run_poisoned(context_attention_fwd_torch, dequantized)
    torch.testing.assert_close(run_poisoned(context_attention_fwd_torch, fp8), want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(run_poisoned(context_attention_fwd_torch, inputs), want, atol=1e-4)


# half_mma: the compiled half-precision path (K and V tiles cast to q's dtype for the MMA)
@pytest.mark.parametrize("options", [dict(block_m=16, block_n=16), dict(block_m=16, block_n=16, pack_gqa=True), {},
                                     dict(_half_mma=True)], ids=["tiles16", "pack", "defaults", "half-mma"])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D,cached,q_lens,alibi,window,softcap", FP8_CASES)
def test_triton_fp8_cache_matches_twin(device, dtype, options, Hq, Hkv, D, cached, q_lens, alibi, window, softcap):
    if options.get("_half_mma") and dtype == torch.float32:
        pytest.skip("the half-precision MMA path is fp16 / bf16's")
    _, fp8, _ = fp8_inputs(21, Hq, Hkv, D, cached, q_lens, alibi, window, softcap, dtype, device)
    want = run_poisoned(context_attention_fwd_torch, fp8)
    assert not want.isnan().any()
    torch.testing.assert_close(run_poisoned(context_attention_fwd_triton, fp8, **options), want, **tol(dtype))
