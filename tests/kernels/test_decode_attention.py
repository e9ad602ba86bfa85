"""decode_attention_fwd: split-K Triton vs twin, and twin vs SDPA on dense gathered K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICE_DTYPES, alibi_slopes, cpu_triton, i32, make_paged_kv, randn, rng, run_poisoned, tol

from llmserve.kernels.decode_attention import decode_attention_fwd_torch, decode_attention_fwd_triton

# (Hq, Hkv, D, seq_lens, block_seq, alibi); block_seq small enough that long sequences span several splits.
CASES = [
    pytest.param(2, 2, 64, [1, 7, 33], 16, False, id="mha-d64-3splits"),
    pytest.param(4, 2, 128, [70, 5], 32, False, id="gqa-d128-3splits"),
    pytest.param(8, 2, 32, [33, 100, 1], 16, True, id="gqa8-d32-alibi-7splits"),
    pytest.param(4, 4, 32, [48, 16], 16, True, id="mha-d32-alibi-exact-splits"),
    pytest.param(4, 2, 64, [300, 17], 256, True, id="gqa-d64-alibi-default-block"),
]


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


@pytest.mark.parametrize("Hq,Hkv,D,seq_lens,block_seq,alibi", CASES)
def test_twin_matches_sdpa(Hq, Hkv, D, seq_lens, block_seq, alibi):
    inputs = make_inputs(0, Hq, Hkv, D, seq_lens, alibi, torch.float32, "cpu")
    got = run_poisoned(decode_attention_fwd_torch, inputs)
    torch.testing.assert_close(got.double(), sdpa_reference(inputs), atol=1e-5, rtol=1e-5)


def test_twin_sm_scale():
    inputs = make_inputs(1, 4, 2, 64, [50, 9], True, torch.float32, "cpu")
    got = run_poisoned(decode_attention_fwd_torch, inputs, sm_scale=0.05)
    torch.testing.assert_close(got.double(), sdpa_reference(inputs, sm_scale=0.05), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D,seq_lens,block_seq,alibi", CASES)
def test_triton_matches_twin(device, dtype, Hq, Hkv, D, seq_lens, block_seq, alibi):
    inputs = make_inputs(2, Hq, Hkv, D, seq_lens, alibi, dtype, device)
    want = run_poisoned(decode_attention_fwd_torch, inputs)
    assert not want.isnan().any()
    got = run_poisoned(decode_attention_fwd_triton, inputs, block_seq=block_seq)
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_triton_sm_scale(device, dtype):
    inputs = make_inputs(3, 4, 2, 32, [40, 3], False, dtype, device)
    want = run_poisoned(decode_attention_fwd_torch, inputs, sm_scale=0.05)
    got = run_poisoned(decode_attention_fwd_triton, inputs, sm_scale=0.05, block_seq=16)
    torch.testing.assert_close(got, want, **tol(dtype))


@cpu_triton
def test_every_split_matters():
    """Guards against vacuous passes: keys in the last split and ALiBi must change the output."""
    base = make_inputs(4, 2, 2, 32, [40], False, torch.float32, "cpu")
    shorter = dict(base, b_seq_len=i32([33], "cpu"))
    with_alibi = dict(base, alibi_slopes=alibi_slopes(2, "cpu"))
    o = run_poisoned(decode_attention_fwd_triton, base, block_seq=16)
    assert not torch.allclose(o, run_poisoned(decode_attention_fwd_triton, shorter, block_seq=16), atol=1e-3)
    assert not torch.allclose(o, run_poisoned(decode_attention_fwd_triton, with_alibi, block_seq=16), atol=1e-3)
