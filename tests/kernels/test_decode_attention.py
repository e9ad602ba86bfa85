"""decode_attention_fwd: split-K Triton vs twin, twin vs SDPA on dense gathered K/V, and the twin's
batch vs each request alone through `sdpa_attention`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import (
    DEVICE_DTYPES, DEVICES, FP8_SCALES, alibi_slopes, compile_for_hopper, cpu_triton, i32, make_paged_kv, randn, rng,
    run_poisoned, tol, with_fp8_cache,
)

from llmserve.kernels import decode_attention
from llmserve.kernels.backend import sdpa_attention
from llmserve.kernels.decode_attention import (
    _batched_sdpa_decode, decode_attention_fwd_torch, decode_attention_fwd_triton, decode_num_splits,
)
from llmserve.kernels.decode_attention_stage1 import decode_attention_stage1_triton
from llmserve.kernels.decode_attention_stage2 import decode_attention_stage2_triton

# (Hq, Hkv, D, seq_lens, (num_splits, block_n), alibi): each request's keys fall into at most
# num_splits splits of a multiple of block_n keys; the ids name the longest request's splits.
CASES = [
    pytest.param(2, 2, 64, [1, 7, 33], (16, 16), False, id="mha-d64-3x16"),
    pytest.param(4, 2, 128, [70, 5], (2, 16), False, id="gqa-d128-2x48"),
    pytest.param(8, 2, 32, [33, 100, 1], (4, 16), True, id="gqa8-d32-alibi-4x32"),
    pytest.param(4, 4, 32, [48, 16], (3, 16), True, id="mha-d32-alibi-3x16-exact"),
    pytest.param(4, 2, 64, [300, 17], None, True, id="gqa-d64-alibi-defaults"),
    pytest.param(2, 1, 32, [200], (1, 16), False, id="mqa-d32-one-split"),
]


def split_args(splits: tuple[int, int] | None) -> dict:
    return {} if splits is None else dict(num_splits=splits[0], block_n=splits[1])


def make_inputs(seed: int, Hq: int, Hkv: int, D: int, seq_lens: list[int], alibi: bool,
                dtype: torch.dtype, device: str) -> dict:
    g = rng(seed)
    kv = make_paged_kv(g, seq_lens, Hkv, D, dtype, device)
    return dict(
        q=randn(g, len(seq_lens), Hq, D, dtype=dtype, device=device),
        k_cache=kv.k_cache, v_cache=kv.v_cache, req_to_token=kv.req_to_token, b_req_idx=kv.b_req_idx,
        b_seq_len=i32(seq_lens, device),
        max_seq_len=max(seq_lens) + 3,  # callers may over-estimate; padding must be ignored
        alibi_slopes=alibi_slopes(Hq, device) if alibi else None, _kv=kv,
    )


def sdpa_reference(inputs: dict, sm_scale: float | None = None) -> torch.Tensor:
    q, kv, slopes = inputs["q"], inputs["_kv"], inputs["alibi_slopes"]
    Hq = q.shape[1]
    out = torch.empty_like(q, dtype=torch.float64)
    for i, n in enumerate(inputs["b_seq_len"].tolist()):
        k, v = kv.dense(i, Hq)  # [Hq, n, D]
        bias = torch.zeros(Hq, 1, n, dtype=torch.float64, device=q.device)
        if slopes is not None:
            bias = bias + slopes.double()[:, None, None] * (torch.arange(n, device=q.device) - (n - 1)).double()
        o = F.scaled_dot_product_attention(q[i, :, None].double(), k, v, attn_mask=bias, scale=sm_scale)
        out[i] = o[:, 0]
    return out


@pytest.mark.parametrize("Hq,Hkv,D,seq_lens,splits,alibi", CASES)
def test_twin_matches_sdpa(Hq, Hkv, D, seq_lens, splits, alibi):
    inputs = make_inputs(0, Hq, Hkv, D, seq_lens, alibi, torch.float32, "cpu")
    got = run_poisoned(decode_attention_fwd_torch, inputs)
    torch.testing.assert_close(got.double(), sdpa_reference(inputs), atol=1e-5, rtol=1e-5)


def test_twin_sm_scale():
    inputs = make_inputs(1, 4, 2, 64, [50, 9], True, torch.float32, "cpu")
    got = run_poisoned(decode_attention_fwd_torch, inputs, sm_scale=0.05)
    torch.testing.assert_close(got.double(), sdpa_reference(inputs, sm_scale=0.05), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D,seq_lens,splits,alibi", CASES)
def test_triton_matches_twin(device, dtype, Hq, Hkv, D, seq_lens, splits, alibi):
    inputs = make_inputs(2, Hq, Hkv, D, seq_lens, alibi, dtype, device)
    want = run_poisoned(decode_attention_fwd_torch, inputs)
    assert not want.isnan().any()
    got = run_poisoned(decode_attention_fwd_triton, inputs, **split_args(splits))
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_triton_sm_scale(device, dtype):
    inputs = make_inputs(3, 4, 2, 32, [40, 3], False, dtype, device)
    want = run_poisoned(decode_attention_fwd_torch, inputs, sm_scale=0.05)
    got = run_poisoned(decode_attention_fwd_triton, inputs, sm_scale=0.05, num_splits=4, block_n=16)
    torch.testing.assert_close(got, want, **tol(dtype))


@cpu_triton
def test_every_split_matters():
    """Guards against vacuous passes: keys in the last split and ALiBi must change the output."""
    base = make_inputs(4, 2, 2, 32, [40], False, torch.float32, "cpu")
    shorter = dict(base, b_seq_len=i32([33], "cpu"))
    with_alibi = dict(base, alibi_slopes=alibi_slopes(2, "cpu"))
    splits = dict(num_splits=3, block_n=16)  # 40 keys: splits of 16, 16 and 8
    o = run_poisoned(decode_attention_fwd_triton, base, **splits)
    assert not torch.allclose(o, run_poisoned(decode_attention_fwd_triton, shorter, **splits), atol=1e-3)
    assert not torch.allclose(o, run_poisoned(decode_attention_fwd_triton, with_alibi, **splits), atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_a_padded_batch_equals_the_batch(device):
    """By default the split count follows the batch size's next power of two, so a batch padded
    up to it (as a CUDA graph's bucket pads it) gives its requests bitwise the same outputs."""
    padded = make_inputs(5, 8, 8, 32, [90, 300, 7, 1], False, torch.float32, device)
    batch = dict(padded, q=padded["q"][:3], b_req_idx=padded["b_req_idx"][:3], b_seq_len=padded["b_seq_len"][:3])
    assert decode_num_splits(3, 8) == decode_num_splits(4, 8) != decode_num_splits(1, 8)
    assert torch.equal(run_poisoned(decode_attention_fwd_triton, padded)[:3], run_poisoned(decode_attention_fwd_triton, batch))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_one_split_writes_what_the_merge_would(device, dtype):
    """With one split a request, stage 1 writes the output and stage 2 is skipped; the bits are
    those of stage 1's fp32 partial merged by stage 2."""
    inputs = make_inputs(9, 8, 2, 64, [70, 5, 129], True, dtype, device)
    got = run_poisoned(decode_attention_fwd_triton, inputs, num_splits=1, block_n=16)
    q = inputs["q"]
    mid_o = torch.empty(*q.shape[:2], 1, q.shape[2], dtype=torch.float32, device=device)
    mid_lse = torch.empty(*q.shape[:2], 1, dtype=torch.float32, device=device)
    args = [inputs[n] for n in ("k_cache", "v_cache", "req_to_token", "b_req_idx", "b_seq_len")]
    decode_attention_stage1_triton(q, *args, mid_o, mid_lse, 64 ** -0.5 * 1.4426950408889634,
                                   inputs["alibi_slopes"], block_n=16)
    merged = torch.empty_like(q)
    decode_attention_stage2_triton(mid_o, mid_lse, merged, inputs["b_seq_len"], block_n=16)
    assert torch.equal(got, merged)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("seq_lens,window,splits", [
    pytest.param([70, 5, 129, 1], 0, (4, 16), id="ragged"),
    pytest.param([300, 17], 50, (8, 16), id="window"),
    pytest.param([33], 0, (32, 16), id="fewer-splits-written-than-launched"),
])
def test_stage1_merges_as_stage2_would(device, dtype, seq_lens, window, splits, monkeypatch):
    """The merge inside stage 1 (the last program of a request and kv head merges) writes stage 2's
    bits, call after call, and leaves every counter it used at zero."""
    inputs = make_inputs(21, 8, 2, 64, seq_lens, True, dtype, device)
    kw = dict(sliding_window=window, **split_args(splits))
    monkeypatch.setattr(decode_attention, "_MERGE", True)
    merged = [run_poisoned(decode_attention_fwd_triton, inputs, **kw) for _ in range(2)]
    counters = decode_attention._merge_counters[inputs["q"].device]   # the merge ran, with this device's counters
    assert not counters.any()
    monkeypatch.setattr(decode_attention, "_MERGE", False)
    two_launches = run_poisoned(decode_attention_fwd_triton, inputs, **kw)
    assert torch.equal(merged[0], two_launches) and torch.equal(merged[1], two_launches)


def test_stage1_compiles_for_hopper_with_the_merge():
    """The merge's count (an atomic at gpu scope) and its L1-bypassing reads, compiled for sm_90."""
    types = dict(Q="*bf16", K="*bf16", V="*bf16", ReqToToken="*i32", BReqIdx="*i32", BSeqLen="*i32", Slopes="*bf16",
                 MidO="*fp32", MidLse="*fp32", qk_scale="fp32", v_scale="fp32", cap="fp32", O="*bf16", Counters="*i32")
    constexprs = dict(HAS_ALIBI=False, HAS_SOFTCAP=False, DOT_PRECISION="tf32", FINAL=False, MERGE=True, BLOCK_N=64,
                      BLOCK_H=16, BLOCK_D=128, PDL=True)
    compile_for_hopper("llmserve.kernels.decode_attention_stage1", "_decode_attention_stage1_kernel", [
        (types, dict(constexprs, HAS_WINDOW=False), 4), (types, dict(constexprs, HAS_WINDOW=True, HAS_SOFTCAP=True), 4),
    ])


def test_split_counts():
    """Small batches get many splits (the GPU would idle otherwise), large ones one."""
    assert [decode_num_splits(bs, 8) for bs in (1, 2, 3, 4, 8, 16, 32, 64, 128)] == [32, 32, 16, 16, 8, 4, 2, 1, 1]
    assert decode_num_splits(1, 1) == 32 and decode_num_splits(1000, 1) == 1


def poison_unread_slots(inputs: dict) -> dict:
    """inputs with NaN in every KV-pool slot that no request reads, slot 0 among them (the twin
    reads slot 0 at a padded batch's padding), and req_to_token past each request's length
    pointing at such slots: whatever is read beyond a request's own keys is NaN."""
    kv = inputs["_kv"]
    k, v, r2t = kv.k_cache.clone(), kv.v_cache.clone(), kv.req_to_token.clone()
    rows = list(zip(kv.b_req_idx.tolist(), kv.kv_lens))
    read = torch.zeros(k.shape[0], dtype=torch.bool)
    for row, n in rows:
        read[r2t[row, :n].long()] = True
    if read[0]:  # move slot 0's token to an unread slot
        spare = int((~read).nonzero()[0])
        k[spare], v[spare] = k[0], v[0]
        r2t[r2t == 0] = spare
        read[spare], read[0] = True, False
    unread = (~read).nonzero().squeeze(1)
    k[unread] = float("nan")
    v[unread] = float("nan")
    g = rng(99)
    for row, n in rows:
        r2t[row, n:] = unread[torch.randint(0, len(unread), (r2t.shape[1] - n,), generator=g)].to(r2t.dtype)
    return dict(inputs, k_cache=k, v_cache=v, req_to_token=r2t)


def per_request_reference(inputs: dict) -> torch.Tensor:
    """Each request alone through `sdpa_attention`, as the twin used to run every batch."""
    q, r2t = inputs["q"], inputs["req_to_token"]
    out = []
    for i, (row, n) in enumerate(zip(inputs["b_req_idx"].tolist(), inputs["b_seq_len"].tolist())):
        slots = r2t[row, :n].long()
        out.append(sdpa_attention(q[i:i + 1], inputs["k_cache"][slots], inputs["v_cache"][slots], q.shape[-1] ** -0.5))
    return torch.cat(out)


# Very different lengths in one batch: most requests are mostly padding when the batch is padded
# to its longest (300); SmolLM2's heads (9 query heads on 3 kv heads).
RAGGED = [1, 300, 7, 64, 2, 129]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seq_lens", [RAGGED, [37, 37, 37]], ids=["ragged", "no-padding"])
def test_twin_batch_is_each_request_alone(dtype, seq_lens):
    """A batch's requests get what each would alone, though the KV pool is NaN wherever none of
    them reads: fails on a batched twin that reads past a request's length, lets a masked NaN
    through, or mixes up requests or kv heads. fp32 runs the batch as one (to rounding); half
    precision per request (bitwise HF's rounding, see decode_attention_fwd_torch)."""
    inputs = poison_unread_slots(make_inputs(6, 9, 3, 64, seq_lens, False, dtype, "cpu"))
    got = run_poisoned(decode_attention_fwd_torch, inputs)
    want = per_request_reference(inputs)
    assert not want.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_batched_path_in_half_precision(dtype):
    """The batched path itself (the twin takes it in fp32 only) holds in half precision too,
    within its rounding."""
    inputs = poison_unread_slots(make_inputs(7, 9, 3, 64, RAGGED, False, dtype, "cpu"))
    got = _batched_sdpa_decode(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["req_to_token"],
                               inputs["b_req_idx"], inputs["b_seq_len"], 64 ** -0.5)
    torch.testing.assert_close(got, per_request_reference(inputs), **tol(dtype))



# -- sliding windows and soft-capping (Gemma 2 / 3) --------------------------------------------------
def masked_reference(inputs: dict, window: int, softcap: float, sm_scale: float) -> torch.Tensor:
    """Dense fp64 decode attention over the last ``window`` keys (all when 0), scores soft-capped."""
    q, kv = inputs["q"], inputs["_kv"]
    out = torch.empty_like(q, dtype=torch.float64)
    for i, n in enumerate(inputs["b_seq_len"].tolist()):
        k, v = kv.dense(i, q.shape[1])                       # [Hq, n, D]
        first = max(0, n - window) if window else 0
        scores = (k[:, first:] @ q[i].double()[:, :, None])[..., 0] * sm_scale   # [Hq, keys]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = (torch.softmax(scores, -1)[:, None, :] @ v[:, first:])[:, 0]
    return out


# (seq_lens, window, softcap, splits): windows shorter and longer than the keys, split or not
DECODE_MASK_CASES = [
    pytest.param([70, 5, 129], 16, 0.0, (4, 16), id="window-split"),
    pytest.param([70, 5, 129], 33, 0.0, (1, 16), id="window-one-split"),
    pytest.param([40, 300], 0, 4.0, (3, 16), id="softcap"),
    pytest.param([90, 1, 200], 50, 2.0, None, id="window-softcap-defaults"),
    pytest.param([10, 20], 1, 0.0, (2, 16), id="window-1"),
]


@pytest.mark.parametrize("seq_lens,window,softcap,splits", DECODE_MASK_CASES)
def test_twin_window_and_softcap(seq_lens, window, softcap, splits):
    inputs = make_inputs(13, 8, 2, 32, seq_lens, False, torch.float32, "cpu")
    got = run_poisoned(decode_attention_fwd_torch, inputs, sliding_window=window, logit_softcap=softcap, sm_scale=0.3)
    torch.testing.assert_close(got.double(), masked_reference(inputs, window, softcap, 0.3), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, run_poisoned(decode_attention_fwd_torch, inputs, sm_scale=0.3), atol=1e-3)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("seq_lens,window,softcap,splits", DECODE_MASK_CASES)
def test_triton_window_and_softcap(device, dtype, seq_lens, window, softcap, splits):
    inputs = make_inputs(14, 8, 2, 32, seq_lens, False, dtype, device)
    masks = dict(sliding_window=window, logit_softcap=softcap, sm_scale=0.3)
    want = run_poisoned(decode_attention_fwd_torch, inputs, **masks)
    got = run_poisoned(decode_attention_fwd_triton, inputs, **masks, **split_args(splits))
    torch.testing.assert_close(got, want, **tol(dtype))


# -- a float8 cache (--kv-cache-dtype fp8) -----------------------------------------------------------
# (Hq, Hkv, D, seq_lens, splits, alibi, window, softcap)
FP8_CASES = [
    pytest.param(4, 2, 128, [70, 5], (2, 16), False, 0, 0.0, id="gqa-d128-2x48"),
    pytest.param(8, 2, 32, [33, 100, 1], (4, 16), True, 0, 0.0, id="gqa8-d32-alibi"),
    pytest.param(8, 2, 32, [90, 1, 129], (1, 16), False, 50, 2.0, id="window-softcap-one-split"),
]


def fp8_inputs(seed: int, Hq, Hkv, D, seq_lens, alibi, window, softcap, dtype, device) -> tuple[dict, dict, dict]:
    """(the unquantized inputs, with their cache in float8, with that cache dequantized)"""
    inputs = dict(make_inputs(seed, Hq, Hkv, D, seq_lens, alibi, dtype, device), sliding_window=window,
                  logit_softcap=softcap)
    return inputs, *with_fp8_cache(inputs, **FP8_SCALES)


@pytest.mark.parametrize("Hq,Hkv,D,seq_lens,splits,alibi,window,softcap", FP8_CASES)
def test_twin_fp8_cache_is_its_dequantized_values(Hq, Hkv, D, seq_lens, splits, alibi, window, softcap):
    inputs, fp8, dequantized = fp8_inputs(15, Hq, Hkv, D, seq_lens, alibi, window, softcap, torch.float32, "cpu")
    want = run_poisoned(decode_attention_fwd_torch, dequantized)
    torch.testing.assert_close(run_poisoned(decode_attention_fwd_torch, fp8), want, atol=1e-6, rtol=1e-5)
    # float8 is not free: the unquantized cache's outputs differ by its rounding
    assert not torch.allclose(run_poisoned(decode_attention_fwd_torch, inputs), want, atol=1e-4)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D,seq_lens,splits,alibi,window,softcap", FP8_CASES)
def test_triton_fp8_cache_matches_twin(device, dtype, Hq, Hkv, D, seq_lens, splits, alibi, window, softcap):
    _, fp8, _ = fp8_inputs(16, Hq, Hkv, D, seq_lens, alibi, window, softcap, dtype, device)
    want = run_poisoned(decode_attention_fwd_torch, fp8)
    assert not want.isnan().any()
    torch.testing.assert_close(run_poisoned(decode_attention_fwd_triton, fp8, **split_args(splits)), want, **tol(dtype))
