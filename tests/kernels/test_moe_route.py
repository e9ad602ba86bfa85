"""select_experts: the twin against HF's routers, Triton against the twin."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICES, randn, rng

from llmserve.kernels.moe_route import select_experts_torch, select_experts_triton


@pytest.mark.parametrize("renormalize", [True, False])
def test_twin_is_hf_router(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    logits, want_w, want_ids = router(torch.randn(5, 16))
    got_w, got_ids = select_experts_torch(logits, 3, renormalize)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,E,k,renormalize", [(1, 8, 2, True), (70, 6, 3, False), (5, 128, 8, True), (3, 60, 1, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_twin(device, n, E, k, renormalize, dtype):
    logits = randn(rng(n * E + k), n, E, dtype=dtype, device=device, scale=3.0)
    want_w, want_ids = select_experts_torch(logits, k, renormalize)
    got_w, got_ids = select_experts_triton(logits, k, renormalize)
    assert got_ids.dtype == torch.int32 and torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
