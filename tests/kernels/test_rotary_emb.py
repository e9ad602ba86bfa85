"""rotary_emb_fwd: twin vs transformers' apply_rotary_pos_emb, Triton vs twin (in place)."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, cos_sin, randn, rng
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from llmserve.kernels.rotary_emb import rotary_emb_fwd_torch, rotary_emb_fwd_triton

# (n, Hq, Hk, D)
SHAPES = [(1, 2, 2, 64), (7, 4, 2, 128), (33, 3, 1, 32)]


@pytest.mark.parametrize("n,Hq,Hk,D", SHAPES)
def test_twin_matches_hf(n, Hq, Hk, D):
    g = rng(D)
    q = randn(g, n, Hq, D, dtype=torch.float32, device="cpu")
    k = randn(g, n, Hk, D, dtype=torch.float32, device="cpu")
    cos, sin = cos_sin(g, n, D, "cpu")
    # HF layout: [batch, heads, seq, D] with full-width cos/sin [batch, seq, D].
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None])
    q2, k2 = q.clone(), k.clone()
    rotary_emb_fwd_torch(q2, k2, cos, sin)
    assert not torch.allclose(q2, q)
    torch.testing.assert_close(q2, want_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k2, want_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,Hq,Hk,D", SHAPES)
def test_triton_matches_twin(device, dtype, n, Hq, Hk, D):
    g = rng(D + 1)
    # q and k as views of one fused qkv projection output, as the models pass them.
    qkv = randn(g, n, Hq + 2 * Hk, D, dtype=dtype, device=device)
    cos, sin = cos_sin(g, n, D, device)
    want = qkv.clone()
    rotary_emb_fwd_torch(want[:, :Hq], want[:, Hq:Hq + Hk], cos, sin)
    got = qkv.clone()
    rotary_emb_fwd_triton(got[:, :Hq], got[:, Hq:Hq + Hk], cos, sin)
    assert not torch.allclose(want[:, :Hq + Hk].float(), qkv[:, :Hq + Hk].float(), atol=1e-2)
    # Bitwise: both round each product and the sum to the dtype, as HF does (no FMA in the kernel).
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got[:, Hq + Hk:], qkv[:, Hq + Hk:], atol=0, rtol=0)  # v untouched


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_triton_on_separate_q_and_k(device, dtype):
    """q and k in tensors of their own: two launches, the same result."""
    g = rng(5)
    n, Hq, Hk, D = 7, 4, 2, 64
    q, k = randn(g, n, Hq, D, dtype=dtype, device=device), randn(g, n, Hk, D, dtype=dtype, device=device)
    cos, sin = cos_sin(g, n, D, device)
    want_q, want_k = q.clone(), k.clone()
    rotary_emb_fwd_torch(want_q, want_k, cos, sin)
    rotary_emb_fwd_triton(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, atol=0, rtol=0)
    torch.testing.assert_close(k, want_k, atol=0, rtol=0)


def test_q_and_k_rotate_in_one_launch_only_when_k_follows_q():
    from llmserve.kernels.rotary_emb import _heads_of_both

    qkv = torch.zeros(5, 4 + 2 * 2, 8)
    both = _heads_of_both(qkv[:, :4], qkv[:, 4:6])
    assert both is not None and both.shape == (5, 6, 8) and both.data_ptr() == qkv.data_ptr()
    assert _heads_of_both(qkv[:, :4], qkv[:, 5:7]) is None        # a gap between them
    assert _heads_of_both(qkv[:, :4], torch.zeros(5, 2, 8)) is None  # another tensor
    assert _heads_of_both(qkv[:3, :4], qkv[:3, 4:6]) is not None


@pytest.mark.parametrize("n", [1, 3])
def test_the_qkv_projections_q_and_k_rotate_in_one_launch(n):
    """As the Llama layer splits its fused projection: flat rows viewed as heads. With one row
    (a batch-1 decode step), view() gives q and k different strides on the size-1 dimension;
    the stride of a dimension of size 1 is never used, so that must not cost a second launch."""
    from llmserve.kernels.rotary_emb import _heads_of_both

    qkv = torch.zeros(n, (4 + 2 * 1) * 8)        # 4 q heads, 1 kv head
    q, kv = qkv[:, :32].view(-1, 4, 8), qkv[:, 32:].view(-1, 2, 8)
    both = _heads_of_both(q, kv[:, :1])
    assert both is not None and both.shape == (n, 5, 8)
    both.fill_(1.0)
    assert (qkv[:, :40] == 1).all() and (qkv[:, 40:] == 0).all()   # q's and k's heads, not v's
