"""GemmaTpPartModel against HF transformers' GemmaForCausalLM on a tiny random-weight model: the
embedding scale, GemmaRMSNorm's 1 + w and the GeGLU MLP. Prefill of a ragged batch plus 16
greedy decode steps, and a prompt fed in chunks on top of the cache."""

from __future__ import annotations

import pytest
from transformers import GemmaConfig

from parity_utils import assert_chunked_prefill_matches_hf, assert_matches_hf_greedy, hf_and_ours, random_prompts

CONFIGS = {
    "mqa-wide-heads": lambda: GemmaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=1, head_dim=48, vocab_size=512,
                                          max_position_embeddings=256),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    return hf_and_ours(CONFIGS, request.param, tmp_path_factory)


def test_prefill_and_decode_match_hf(models):
    hf, ours = models
    assert type(ours).__name__ == "GemmaTpPartModel"
    assert_matches_hf_greedy(ours, hf, random_prompts([5, 12, 1, 9], 512), steps=16)


def test_chunked_prefill_matches_full_prompt(models):
    hf, ours = models
    assert_chunked_prefill_matches_hf(ours, hf, random_prompts([14], 512, seed=2)[0], cuts=[7, 13])
