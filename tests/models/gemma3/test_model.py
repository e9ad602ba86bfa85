"""Gemma3TpPartModel against HF transformers' Gemma3ForCausalLM (``gemma3_text``) on tiny
random-weight models: q/k norms, two sliding layers (window 8) to one global, the sliding layers'
own rotary base and the global layers' linear rope scaling. Prefill of a ragged batch plus 16
greedy decode steps past the window, and a prompt fed in chunks across it."""

from __future__ import annotations

import pytest
from transformers import Gemma3TextConfig

from parity_utils import assert_matches_hf_past_the_window, hf_and_ours

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=512, max_position_embeddings=256, sliding_window=8, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"])

CONFIGS = {
    # as Gemma 3 4B-27B: linear scaling (factor 8) on the global layers only
    "scaled-global": lambda: Gemma3TextConfig(**TINY, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}),
    # as Gemma 3 1B (no scaling), with the legacy config keys and an attention soft-cap set
    "legacy-keys-softcap": lambda: Gemma3TextConfig(**TINY, rope_theta=1_000_000.0, rope_local_base_freq=100.0,
                                                    attn_logit_softcapping=5.0, final_logit_softcapping=10.0),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    return hf_and_ours(CONFIGS, request.param, tmp_path_factory)


def test_the_config_shapes_the_model(models):
    hf, ours = models
    cfg = hf.config
    assert type(ours).__name__ == "Gemma3TpPartModel"
    assert [layer.sliding_window_ for layer in ours.layers_infer] == [8, 8, 0]
    local = cfg.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.local_rotary_emb._cos.shape == ours.rotary_emb._cos.shape
    assert ours.local_rotary_emb.rope_type == "default" and local != cfg.rope_parameters["full_attention"]["rope_theta"]


def test_prefill_decode_and_chunks_past_the_window_match_hf(models):
    hf, ours = models
    assert_matches_hf_past_the_window(ours, hf, 512)
