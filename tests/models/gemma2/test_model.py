"""Gemma2TpPartModel against HF transformers' Gemma2ForCausalLM on tiny random-weight models with a
sliding window of 8 tokens on alternate layers, so that prompts and decodes run well past it:
post-norms, query_pre_attn_scalar, attention and final-logit soft-capping. Prefill of a ragged
batch plus 16 greedy decode steps, a prompt fed in chunks across the window, and a prefix-cache
hit (a second request reusing the first's cached prefix slots)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config

from parity_utils import (
    BatchDriver, LOGITS_TOL, assert_matches_hf_past_the_window, build_tiny_hf_model, hf_and_ours, load_ours, random_prompts,
    rel_err,
)

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=512, max_position_embeddings=256, sliding_window=8)

CONFIGS = {
    # small caps so that capping changes the scores of these wide random weights
    "softcaps": lambda: Gemma2Config(**TINY, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                     final_logit_softcapping=10.0),
    "no-caps": lambda: Gemma2Config(**(TINY | dict(num_hidden_layers=3)), query_pre_attn_scalar=32, attn_logit_softcapping=None,
                                    final_logit_softcapping=None),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    return hf_and_ours(CONFIGS, request.param, tmp_path_factory)


def test_the_config_shapes_the_layers(models):
    hf, ours = models
    cfg = hf.config
    assert [layer.sliding_window_ for layer in ours.layers_infer] == [
        8 if t == "sliding_attention" else 0 for t in cfg.layer_types]
    assert ours.layers_infer[0].sm_scale_ == cfg.query_pre_attn_scalar ** -0.5
    assert ours.layers_infer[0].logit_softcap_ == (cfg.attn_logit_softcapping or 0.0)


def test_prefill_decode_and_chunks_past_the_window_match_hf(models):
    hf, ours = models
    assert_matches_hf_past_the_window(ours, hf, 512)


def test_prefix_cache_hit_past_the_window_matches_hf(models):
    """A second request whose first 20 tokens are the first request's: its table row points at
    the first request's slots for them (as the prefix cache shares them) and only the rest is
    computed; its logits are HF's over the whole prompt."""
    hf, ours = models
    first, rest = random_prompts([20, 11], 512, seed=3)
    driver = BatchDriver(ours)
    try:
        driver.prefill([first])
        rm = ours.req_manager
        row = rm.alloc_req()
        driver.rows.append(row)   # freed with the driver's
        rm.share_prefix(row, rm.slots(driver.rows[0], 0, 20))
        got = ours.forward(torch.tensor(rest), [row], [20], [len(rest)], return_all_logits=True)
        with torch.no_grad():
            ref = hf(torch.tensor([first + rest])).logits[0, 20:].float()
        assert rel_err(got.cpu(), ref) < LOGITS_TOL
    finally:
        driver.free()
    assert ours.mem_manager.can_use_mem_size == ours.mem_manager.size


def test_an_exact_gelu_is_refused(tmp_path):
    """The GeGLU kernel computes the tanh GELU every Gemma 2 / 3 checkpoint names; a config asking
    for the exact one fails at load rather than serving other numbers."""
    build_tiny_hf_model(Gemma2Config(**TINY, hidden_activation="gelu"), tmp_path)
    with pytest.raises(ValueError, match="hidden activation 'gelu'"):
        load_ours(tmp_path)
