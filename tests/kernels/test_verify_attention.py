"""verify_attention_fwd: the split-K Triton kernel of a few new tokens a request against the context
twin (its twin) and the context Triton kernel, on ragged query counts, GQA, ALiBi, sliding windows,
soft-capping and a float8 cache; the splits a row sees nothing of; padding requests."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, DEVICES, FP8_SCALES, cpu_triton, i32, run_poisoned, tol, with_fp8_cache
from test_context_attention import make_inputs  # the context kernel's inputs: the same operation

from llmserve.kernels import set_backend
from llmserve.kernels.context_attention import context_attention_fwd_triton
from llmserve.kernels.decode_attention import decode_num_splits
from llmserve.kernels.verify_attention import (
    VERIFY_MAX_Q_LEN, verify_attention_fwd, verify_attention_fwd_torch, verify_attention_fwd_triton, verify_num_splits,
)

# (Hq, Hkv, D, cached_lens, q_lens, alibi, masks, splits): ragged query counts (one new token
# beside a draft, 1 + K), keys in several splits of block_n = 16 (or the defaults), splits past a
# request's keys, the last split past an early row's position (31 cached + 5: row 0 sees nothing
# of the keys 32..35).
CASES = [
    pytest.param(4, 2, 32, [31, 3, 100], [5, 1, 9], False, {}, (4, 16), id="gqa-ragged"),
    pytest.param(8, 2, 64, [40, 7], [16, 2], True, {}, (3, 16), id="gqa4-alibi-16-tokens"),
    pytest.param(2, 2, 32, [20, 0], [3, 4], False, {}, (8, 16), id="mha-prefill-and-more-splits"),
    pytest.param(4, 1, 32, [70, 33], [9, 6], False, dict(sliding_window=20), (3, 16), id="mqa-window"),
    pytest.param(4, 2, 32, [50, 5], [7, 3], False, dict(sliding_window=1, logit_softcap=3.0), (2, 16),
                 id="window-1-softcap"),
    pytest.param(4, 2, 64, [130, 2], [5, 9], False, dict(logit_softcap=5.0, sm_scale=0.2), None, id="softcap-defaults"),
    # a group of 8 heads x up to 9 queries: 72 rows, two row blocks of 64 (one for the short request)
    pytest.param(8, 1, 32, [20, 45], [9, 3], True, {}, (2, 16), id="mqa8-alibi-row-blocks"),
    pytest.param(16, 2, 32, [20, 45], [9, 3], False, dict(sliding_window=30), (2, 16), id="gqa8-window-row-blocks"),
]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D,cached,q_lens,alibi,masks,splits", CASES)
def test_triton_matches_twin_and_context_kernel(device, dtype, Hq, Hkv, D, cached, q_lens, alibi, masks, splits):
    inputs = make_inputs(30, Hq, Hkv, D, cached, q_lens, alibi, dtype, device)
    want = run_poisoned(verify_attention_fwd_torch, inputs, **masks)
    assert not want.isnan().any()
    split_args = {} if splits is None else dict(num_splits=splits[0], block_n=splits[1])
    got = run_poisoned(verify_attention_fwd_triton, inputs, **masks, **split_args)
    torch.testing.assert_close(got, want, **tol(dtype))
    context = run_poisoned(context_attention_fwd_triton, inputs, **masks, block_m=16, block_n=16)
    torch.testing.assert_close(got, context, **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_fp8_cache_matches_twin(device, dtype):
    inputs = dict(make_inputs(31, 8, 2, 32, [45, 9], [6, 1], False, dtype, device), sliding_window=30,
                  logit_softcap=3.0)
    fp8, _ = with_fp8_cache(inputs, **FP8_SCALES)
    want = run_poisoned(verify_attention_fwd_torch, fp8)
    assert not want.isnan().any()
    torch.testing.assert_close(run_poisoned(verify_attention_fwd_triton, fp8, num_splits=3, block_n=16), want,
                               **tol(dtype))


@cpu_triton
def test_every_split_matters():
    """Guards against vacuous passes: the keys of each split and the newest key (the last split,
    which the first row does not see) change what the rows that see them get."""
    base = make_inputs(32, 4, 2, 32, [31], [5], False, torch.float32, "cpu")
    splits = dict(num_splits=3, block_n=16)  # 36 keys: 0..15, 16..31, 32..35
    o = run_poisoned(verify_attention_fwd_triton, base, **splits)
    for pos in (3, 20, 35):  # a key of each split
        k_cache = base["k_cache"].clone()
        k_cache[base["req_to_token"][base["b_req_idx"][0], pos].long()] *= 3
        changed = run_poisoned(verify_attention_fwd_triton, dict(base, k_cache=k_cache), **splits)
        seen_by = [j for j in range(5) if 31 + j >= pos]
        assert not torch.allclose(o[seen_by], changed[seen_by], atol=1e-3)
        assert torch.equal(o[: 5 - len(seen_by)], changed[: 5 - len(seen_by)])


@pytest.mark.parametrize("device", DEVICES)
def test_padding_requests_change_nothing(device):
    """A verify graph's batch: requests past the step's bring no new token (q_len 0), more of
    them than the step has rows (those get no programs). The real requests' rows come out bitwise
    as in the batch without them, when the splits are the same."""
    padded = make_inputs(33, 4, 2, 32, [40, 17, 0, 0, 0, 0], [2, 1, 0, 0, 0, 0], False, torch.float32, device)
    batch = dict(padded, **{name: padded[name][:2] for name in ("b_req_idx", "b_q_start", "b_q_len", "b_cached_len")})
    splits = dict(num_splits=4, block_n=16)
    assert torch.equal(run_poisoned(verify_attention_fwd_triton, padded, **splits),
                       run_poisoned(verify_attention_fwd_triton, batch, **splits))


@pytest.mark.parametrize("device", DEVICES)
def test_too_many_new_tokens_is_refused(device):
    inputs = make_inputs(34, 2, 1, 32, [5], [VERIFY_MAX_Q_LEN + 1], False, torch.float32, device)
    with pytest.raises(ValueError, match=f"at most {VERIFY_MAX_Q_LEN} new tokens"):
        run_poisoned(verify_attention_fwd_triton, inputs)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=cpu_triton)])
def test_dispatcher_follows_the_backend(backend):
    inputs = make_inputs(35, 4, 2, 32, [12, 3], [3, 1], False, torch.float32, "cpu")
    chosen = verify_attention_fwd_torch if backend == "torch" else verify_attention_fwd_triton
    set_backend(backend)
    try:
        assert torch.equal(run_poisoned(verify_attention_fwd, inputs), run_poisoned(chosen, inputs))
    finally:
        set_backend(None)


def test_splits_follow_the_rows_not_the_padded_batch():
    """A verify graph pads the batch to its largest (32) but the rows only to a bucket: one request
    of 1 + 4 tokens (a bucket of 8 rows) is cut as a decode step of one request is, eight are cut
    as a decode step of eight."""
    assert verify_num_splits(32, 8, 5, 8) == decode_num_splits(1, 8) > decode_num_splits(32, 8)
    assert verify_num_splits(8, 40, 5, 8) == verify_num_splits(32, 40, 5, 8) == decode_num_splits(8, 8)
