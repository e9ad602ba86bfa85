"""fused_moe: the twin against a per-token float64 reference, Triton against the twin (the
align kernel's blocks checked on their own), and select_experts against HF's routers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICE_DTYPES, DEVICES, randn, rng, tol

from llmserve.kernels.fused_moe import fused_moe_torch, fused_moe_triton, moe_align, select_experts

# (tokens, hidden, intermediate, experts, top_k): a decode-sized batch, more rows than one block
# for some experts, widths that are no power of two, a single token; by rows per expert the
# three tile configurations (16, 32 and 64 rows a block)
SHAPES = [(1, 64, 32, 8, 2), (5, 48, 40, 4, 2), (40, 64, 96, 6, 3), (130, 32, 32, 4, 2)]


def make_inputs(n, H, I, E, k, dtype, device, seed=0):
    g = rng(seed)
    x = randn(g, n, H, dtype=dtype, device=device)
    w13 = randn(g, E, 2 * I, H, dtype=dtype, device=device, scale=H ** -0.5)
    w2 = randn(g, E, H, I, dtype=dtype, device=device, scale=I ** -0.5)
    weights, ids = select_experts(randn(g, n, E, dtype=torch.float32, device=device), k, renormalize=True)
    return x, w13, w2, weights, ids


def reference(x, w13, w2, weights, ids):
    """Each token on its own, in float64."""
    I = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            gu = w13[e].double() @ x[t].double()
            out[t] += weights[t, slot].double() * (w2[e].double() @ (F.silu(gu[:I]) * gu[I:]))
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_twin_matches_reference(shape):
    inputs = make_inputs(*shape, dtype=torch.float32, device="cpu")
    torch.testing.assert_close(fused_moe_torch(*inputs).double(), reference(*inputs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_twin(device, dtype, shape):
    inputs = make_inputs(*shape, dtype=dtype, device=device, seed=1)
    got = fused_moe_triton(*inputs)
    assert got.dtype == dtype and got.shape == inputs[0].shape
    torch.testing.assert_close(got, fused_moe_torch(*inputs), **tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_align_sorts_every_pair_into_its_experts_blocks(device):
    """Each expert's pairs fill whole blocks of that expert, in pair order; the rest is padding."""
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]], device=device)  # pairs 0..7, row-major
    sorted_pairs, block_expert, num_padded = moe_align(ids, num_experts=5, block_m=2)
    used = int(num_padded)
    assert used == 2 + 2 + 2 + 4  # expert 4 has none; expert 3's four pairs fill two blocks
    rows = sorted_pairs[:used].view(-1, 2).tolist()
    assert block_expert[: used // 2].tolist() == [0, 1, 2, 3, 3]
    P = ids.numel()
    assert rows == [[1, 4], [3, P], [7, P], [0, 2], [5, 6]]


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_is_hf_router(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(5, 16)
    logits, want_w, want_ids = router(x)
    got_w, got_ids = select_experts(logits, 3, renormalize)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=0, rtol=0)
