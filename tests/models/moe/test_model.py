"""The mixture-of-experts families against HF transformers on tiny random-weight models:
Mixtral (top-2 of 4, renormalised), Qwen3-MoE (top-2 of 8, with and without renormalisation,
a dense layer by ``decoder_sparse_step``) and Qwen2-MoE (q/k/v bias, a shared expert under a
sigmoid gate, a dense layer by ``mlp_only_layers``). Prefill of a ragged batch plus greedy decode
steps, and a prompt fed in chunks on top of the cache. transformers 5 saves the experts one
tensor each, as published checkpoints have them, and that is what these load."""

from __future__ import annotations

import pytest
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from triton.runtime.interpreter import InterpretedFunction

from parity_utils import (
    TEST_DEVICE, assert_chunked_prefill_matches_hf, assert_matches_hf_greedy, hf_and_ours, random_prompts,
)

from llmserve.common.basemodel import moe
from llmserve.kernels.fused_moe import _fused_moe_kernel, fused_moe_triton
from llmserve.kernels.moe_route import select_experts_triton

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=256)

CONFIGS = {
    "mixtral": lambda: MixtralConfig(**TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    "qwen3-moe-renorm": lambda: Qwen3MoeConfig(**TINY, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                                               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen3-moe-dense-layer": lambda: Qwen3MoeConfig(**TINY, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                                    num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                                                    decoder_sparse_step=2, tie_word_embeddings=True),
    "qwen2-moe-shared": lambda: Qwen2MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=64, num_experts=4,
                                               num_experts_per_tok=2, mlp_only_layers=[1]),
}
# Triton kernels run on CPU tensors only when interpreted (tests/conftest.py, without CUDA)
interpreted_or_cuda = pytest.mark.skipif(TEST_DEVICE == "cpu" and not isinstance(_fused_moe_kernel, InterpretedFunction),
                                         reason="Triton kernels on CPU need the interpreter; set LLMSERVE_TEST_DEVICE=cuda")
DENSE_LAYERS = {"qwen3-moe-dense-layer": [0], "qwen2-moe-shared": [1]}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    return request.param, *hf_and_ours(CONFIGS, request.param, tmp_path_factory)


def test_the_config_shapes_the_layers(models):
    name, hf, ours = models
    for i, layer in enumerate(ours.trans_layers_weight):
        if i in DENSE_LAYERS.get(name, []):
            assert layer.moe_ is None and layer.gate_up_weight_ is not None
            continue
        experts = getattr(hf.config, "num_local_experts", None) or hf.config.num_experts
        inter = getattr(hf.config, "moe_intermediate_size", None) or hf.config.intermediate_size
        assert layer.moe_.w13.shape == (experts, 2 * inter, hf.config.hidden_size)
        assert (layer.moe_.shared_gate is not None) == (name == "qwen2-moe-shared")


def test_prefill_and_decode_match_hf(models):
    _, hf, ours = models
    assert_matches_hf_greedy(ours, hf, random_prompts([5, 12, 1, 9], 512), steps=12)


def test_chunked_prefill_matches_full_prompt(models):
    _, hf, ours = models
    assert_chunked_prefill_matches_hf(ours, hf, random_prompts([14], 512, seed=2)[0], cuts=[7, 13])


@interpreted_or_cuda
def test_fused_moe_kernel_in_the_model_matches_hf(models, monkeypatch):
    """The Triton router and experts (route, align, grouped GEMMs) inside the model, prefill and decode: HF's
    logits and greedy tokens. On CPU through the interpreter, the other ops staying on their
    twins (the twin of fused_moe runs the tests above there)."""
    _, hf, ours = models
    monkeypatch.setattr(moe, "fused_moe", fused_moe_triton)
    monkeypatch.setattr(moe, "select_experts", select_experts_triton)
    assert_matches_hf_greedy(ours, hf, random_prompts([6, 1, 11], 512, seed=3), steps=3)
