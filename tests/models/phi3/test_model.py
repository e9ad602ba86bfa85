"""Phi3TpPartModel against HF transformers' Phi3ForCausalLM on tiny random-weight models: plain
rotary with untied embeddings; LongRoPE with the original context (16) crossed by some requests in
their prefill and by others while decoding; and Phi-4-mini's shape, tied embeddings with partial
rotary (0.75 of each head) under LongRoPE. Prefill of a ragged batch plus 16 greedy decode steps,
and a prompt fed in chunks on top of the cache.

A prompt fed in chunks across the original context is not compared: its first chunks are rotated
with the short factors, while HF, prefilling it whole, rotates every position with the long ones."""

from __future__ import annotations

import pytest
from transformers import Phi3Config

from parity_utils import (
    assert_chunked_prefill_matches_hf, assert_matches_hf_greedy, build_tiny_hf_model, hf_and_ours, load_ours, random_prompts,
)

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def longrope(pairs: int) -> dict:
    # factors far apart, so rotating a token with the wrong set is an O(1) error
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
            "long_factor": [1.0 + 1.5 * i for i in range(pairs)]}


CONFIGS = {
    "untied-plain": lambda: Phi3Config(**TINY, tie_word_embeddings=False),
    "untied-longrope": lambda: Phi3Config(**TINY, tie_word_embeddings=False, original_max_position_embeddings=16,
                                          rope_scaling=longrope(16)),
    # Phi-4-mini: tied, 3/4 of each head rotates (24 of 32 dimensions: 12 pairs of factors)
    "tied-partial-longrope": lambda: Phi3Config(**TINY, tie_word_embeddings=True, partial_rotary_factor=0.75,
                                                original_max_position_embeddings=16, rope_scaling=longrope(12)),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    return hf_and_ours(CONFIGS, request.param, tmp_path_factory)


def test_the_config_shapes_the_model(models):
    hf, ours = models
    cfg = hf.config
    assert type(ours).__name__ == "Phi3TpPartModel"
    tied = ours.pre_post_weight.lm_head_weight_ is ours.pre_post_weight.wte_weight_
    assert tied == cfg.tie_word_embeddings
    head = cfg.hidden_size // cfg.num_attention_heads
    # the fused checkpoint tensors were cut apart and fused again: same shapes as Llama's
    assert ours.trans_layers_weight[0].qkv_weight_.shape == ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head,
                                                            cfg.hidden_size)
    assert ours.trans_layers_weight[0].gate_up_weight_.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert ours.rotary_emb.rotary_dim == int(head * cfg.rope_parameters["partial_rotary_factor"])
    assert ours.rotary_emb.long_after == (16 if "longrope" in cfg.rope_parameters["rope_type"] else None)


def test_prefill_and_decode_match_hf(models):
    """Prompts of 5, 20, 1 and 9 tokens, 16 steps each: under LongRoPE the 20-token prompt is long
    from its prefill, the others turn long part-way through their decode."""
    hf, ours = models
    assert_matches_hf_greedy(ours, hf, random_prompts([5, 20, 1, 9], 512), steps=16)


def test_chunked_prefill_matches_full_prompt(models):
    """7 + 6 + 1 tokens on top of the cache, within the original context."""
    hf, ours = models
    assert_chunked_prefill_matches_hf(ours, hf, random_prompts([14], 512, seed=2)[0], cuts=[7, 13])


def test_a_sliding_window_matches_hf_past_the_window(tmp_path):
    """HF applies Phi-3's sliding_window (Phi-3-mini-4k: 2047 of 4096) to every layer; so do the
    attention kernels, and requests are not capped at it."""
    hf = build_tiny_hf_model(Phi3Config(**TINY, sliding_window=8), tmp_path)
    ours = load_ours(tmp_path)
    assert ours.max_seq_len > 8 and [layer.sliding_window_ for layer in ours.layers_infer] == [8, 8]
    assert_matches_hf_greedy(ours, hf, random_prompts([5, 20], 512), steps=8)
    assert_chunked_prefill_matches_hf(ours, hf, random_prompts([24], 512, seed=2)[0], cuts=[7, 13])
