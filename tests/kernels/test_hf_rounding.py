"""In half precision the torch twins round exactly as HF transformers' own ops do.

Every eager op rounds its output to the tensor's dtype, so two ways of computing the same value
that agree in fp32 can differ by a unit in the last place in bf16; through 30 layers that was
enough to turn the embedded SmolLM2's "The capital of France is Paris." into "L'Étoile, ...".
These pin each twin to HF's op order bitwise (the CPU path is the twins), where the other
tests of each kernel only bound its error.
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import i32, make_paged_kv, randn, rng
from transformers.activations import ACT2FN
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from llmserve.kernels.context_attention import context_attention_fwd_torch
from llmserve.kernels.decode_attention import decode_attention_fwd_torch
from llmserve.kernels.rotary_emb import rotary_emb_fwd_torch
from llmserve.kernels.silu_and_mul import silu_and_mul_fwd_torch

HALF = [torch.bfloat16, torch.float16]


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    differ = (got != want).sum().item()
    assert differ == 0, f"{differ} of {want.numel()} values differ, max {(got.float() - want.float()).abs().max():.3g}"


@pytest.mark.parametrize("dtype", HALF)
def test_rotary_twin_is_hf_apply_rotary_pos_emb(dtype):
    g = rng(0)
    n, Hq, Hk, D = 37, 9, 3, 64
    q, k = randn(g, n, Hq, D, dtype=dtype, device="cpu"), randn(g, n, Hk, D, dtype=dtype, device="cpu")
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(n).float()[:, None] * inv_freq  # fp32 tables, as RotaryEmbedding keeps them
    cos, sin = freqs.cos(), freqs.sin()
    # HF's LlamaRotaryEmbedding hands cos/sin over in the activations' dtype.
    full = lambda t: torch.cat((t, t), -1)[None].to(dtype)  # noqa: E731
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], full(cos), full(sin))
    rotary_emb_fwd_torch(q, k, cos, sin)
    assert_bitwise(q, want_q[0].transpose(0, 1))
    assert_bitwise(k, want_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", HALF)
def test_silu_and_mul_twin_is_hf_llama_mlp(dtype):
    I = 1536
    x = randn(rng(1), 37, 2 * I, dtype=dtype, device="cpu", scale=4.0)
    assert_bitwise(silu_and_mul_fwd_torch(x), ACT2FN["silu"](x[:, :I]) * x[:, I:])


class _HFAttention(torch.nn.Module):
    """What sdpa_attention_forward reads off HF's attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def hf_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF's "sdpa" attention of one sequence without padding (no mask), q [n, Hq, D], k/v [L, Hkv, D]."""
    D = q.shape[-1]
    out, _ = sdpa_attention_forward(_HFAttention(q.shape[1] // k.shape[1]), q.transpose(0, 1)[None],
                                    k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, scaling=D ** -0.5)
    return out[0]  # [n, Hq, D]


@pytest.mark.parametrize("dtype", HALF)
def test_context_attention_twin_is_hf_sdpa(dtype):
    """A prefill batch (no cached prefix: HF's own prefill) through the paged twin."""
    g = rng(2)
    Hq, Hkv, D, q_lens = 9, 3, 64, [37, 5, 1]
    kv = make_paged_kv(g, q_lens, Hkv, D, dtype, "cpu")
    q = randn(g, sum(q_lens), Hq, D, dtype=dtype, device="cpu")
    starts = [0, q_lens[0], q_lens[0] + q_lens[1]]
    o = torch.full_like(q, float("nan"))
    context_attention_fwd_torch(q, kv.k_cache, kv.v_cache, o, kv.req_to_token, kv.b_req_idx, i32(starts, "cpu"),
                                i32(q_lens, "cpu"), i32([0, 0, 0], "cpu"), max(q_lens))
    for i, (s, n) in enumerate(zip(starts, q_lens)):
        slots = kv.req_to_token[kv.b_req_idx[i], :n].long()
        assert_bitwise(o[s:s + n], hf_sdpa(q[s:s + n], kv.k_cache[slots], kv.v_cache[slots]))


@pytest.mark.parametrize("dtype", HALF)
def test_decode_attention_twin_is_hf_sdpa(dtype):
    g = rng(3)
    Hq, Hkv, D, seq_lens = 9, 3, 64, [40, 7, 1]
    kv = make_paged_kv(g, seq_lens, Hkv, D, dtype, "cpu")
    q = randn(g, len(seq_lens), Hq, D, dtype=dtype, device="cpu")
    o = torch.full_like(q, float("nan"))
    decode_attention_fwd_torch(q, kv.k_cache, kv.v_cache, o, kv.req_to_token, kv.b_req_idx, i32(seq_lens, "cpu"),
                               max(seq_lens))
    for i, n in enumerate(seq_lens):
        slots = kv.req_to_token[kv.b_req_idx[i], :n].long()
        assert_bitwise(o[i:i + 1], hf_sdpa(q[i:i + 1], kv.k_cache[slots], kv.v_cache[slots]))
