"""Qwen3TpPartModel against HF transformers' Qwen3ForCausalLM on tiny random-weight models: untied
embeddings with the usual head size and YaRN rope scaling, and tied embeddings with a head size that is not hidden /
heads (as Qwen3-0.6B's 128 for 1024 / 16). Prefill of a ragged batch plus 16 greedy decode steps,
and a prompt fed in chunks on top of the cache."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config

from parity_utils import assert_chunked_prefill_matches_hf, assert_matches_hf_greedy, hf_and_ours, random_prompts

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=256)

CONFIGS = {
    # with the YaRN scaling Qwen3's model cards suggest for long contexts (here past 64 tokens)
    "untied-yarn": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "tied-wide-heads": lambda: Qwen3Config(**TINY, head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    return hf_and_ours(CONFIGS, request.param, tmp_path_factory)


def test_the_config_shapes_the_model(models):
    hf, ours = models
    cfg = hf.config
    assert type(ours).__name__ == "Qwen3TpPartModel"
    assert ours.layers_infer[0].head_dim_ == cfg.head_dim and ours.mem_manager.head_dim == cfg.head_dim
    tied = ours.pre_post_weight.lm_head_weight_ is ours.pre_post_weight.wte_weight_
    assert tied == cfg.tie_word_embeddings
    assert ours.trans_layers_weight[0].q_norm_weight_.shape == (cfg.head_dim,)


def test_prefill_and_decode_match_hf(models):
    hf, ours = models
    assert_matches_hf_greedy(ours, hf, random_prompts([5, 12, 1, 9], 512), steps=16)


def test_chunked_prefill_matches_full_prompt(models):
    """7 + 6 + 1 tokens on top of the cache: each position's logits are HF's over the whole
    prompt (the q/k norms act on new tokens only; the cache holds normalised, rotated keys)."""
    hf, ours = models
    assert_chunked_prefill_matches_hf(ours, hf, random_prompts([14], 512, seed=2)[0], cuts=[7, 13])
