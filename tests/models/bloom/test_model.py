"""BloomTpPartModel (ALiBi, LayerNorm, fused query_key_value) against HF transformers."""

from __future__ import annotations

import pytest
from transformers import BloomConfig

from parity_utils import assert_chunked_prefill_matches_hf, assert_matches_hf_greedy, build_tiny_hf_model, load_ours, random_prompts


@pytest.fixture(scope="module", params=[4, 6])
def models(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"bloom{request.param}")
    cfg = BloomConfig(hidden_size=96 if request.param == 6 else 128, n_head=request.param, n_layer=2, vocab_size=512)
    hf = build_tiny_hf_model(cfg, path)
    return hf, load_ours(path)


def test_prefill_and_decode_match_hf(models):
    hf, ours = models
    assert_matches_hf_greedy(ours, hf, random_prompts([5, 12, 1, 9], 512), steps=16)


def test_chunked_prefill_matches_full_prompt(models):
    hf, ours = models
    assert_chunked_prefill_matches_hf(ours, hf, random_prompts([11], 512, seed=5)[0], cuts=[4])
