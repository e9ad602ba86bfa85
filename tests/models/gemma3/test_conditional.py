"""Gemma3ConditionalTpPartModel (``gemma3``: Gemma3ForConditionalGeneration checkpoints, Gemma 3
4B-27B) serves the text decoder: against HF's model on text-only prompts, with the checkpoint's
tensors named as transformers saves them and as ``model.language_model.*``; the vision tower's
tensors are skipped."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

from parity_utils import assert_matches_hf_past_the_window, build_tiny_hf_model, load_ours


def tiny_config() -> Gemma3Config:
    text = Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=256,
                            sliding_window=8, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=500,
                        boi_token_index=501, eoi_token_index=502)


@pytest.fixture(scope="module", params=["as-saved", "model.language_model"])
def models(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-conditional")
    hf = build_tiny_hf_model(tiny_config(), path)
    if request.param == "model.language_model":
        file = os.path.join(path, "model.safetensors")
        state = load_file(file)
        save_file({name.replace("language_model.model.", "model.language_model."): t for name, t in state.items()},
                  file, metadata={"format": "pt"})
    return hf, load_ours(path)


def test_the_text_decoder_is_served(models):
    hf, ours = models
    assert type(ours).__name__ == "Gemma3ConditionalTpPartModel" and ours.model_type == "gemma3"
    assert ours.network_config_.model_type == "gemma3_text" and not ours.extra_weights
    assert getattr(ours, "image_token_id", None) is None


def test_prefill_decode_and_chunks_past_the_window_match_hf(models):
    hf, ours = models
    assert_matches_hf_past_the_window(ours, hf, 500, steps=8)
