"""Gemma 1, 2 and 3 GGUF files, written as llama.cpp's converter writes them (gguf-py's own tensor
names, norm weights stored as 1 + w, Gemma 2's soft-caps and Gemma 3's rope scaling in the
metadata), read into our Gemma classes give HF's logits and greedy tokens on the same weights:
past the sliding window, and in chunks across it."""

from __future__ import annotations

import gguf
import pytest
from transformers import Gemma2Config, GemmaConfig, Gemma3TextConfig

from gguf_utils import checkpoint_tensors, write_converted_gguf
from parity_utils import assert_matches_hf_greedy, assert_matches_hf_past_the_window, build_tiny_hf_model, random_prompts

from llmserve.common.basemodel import ModelInitParams
from llmserve.models.registry import get_model_class, peek_model_config

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=256, max_position_embeddings=256)


def _gemma2_kv(w: gguf.GGUFWriter) -> None:
    w.add_attn_logit_softcapping(5.0)
    w.add_final_logit_softcapping(10.0)
    w.add_sliding_window(8)


def _gemma3_kv(w: gguf.GGUFWriter) -> None:
    w.add_sliding_window(8)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)


# name -> (HF config, the metadata llama.cpp writes beyond the common keys, our class)
CASES = {
    "gemma": (lambda: GemmaConfig(**TINY, num_hidden_layers=2), None, "GemmaTpPartModel"),
    # the query scale llama.cpp uses for every size but 27B is the head size
    "gemma2": (lambda: Gemma2Config(**TINY, num_hidden_layers=2, query_pre_attn_scalar=16, sliding_window=8,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=10.0),
               _gemma2_kv, "Gemma2TpPartModel"),
    # six layers: five sliding to one global, as llama.cpp assumes; the global layers scaled by 8
    "gemma3": (lambda: Gemma3TextConfig(**TINY, num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=8,
                                        rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1_000_000.0}}),
               _gemma3_kv, "Gemma3TpPartModel"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gemma_gguf_matches_hf(tmp_path, name):
    make_config, extra_kv, class_name = CASES[name]
    hf = build_tiny_hf_model(make_config(), tmp_path / "hf")
    path = tmp_path / f"tiny-{name}.gguf"
    write_converted_gguf(path, hf.config, checkpoint_tensors(tmp_path / "hf"), norm_shift=1.0, extra_kv=extra_kv)

    cfg = peek_model_config(str(path))
    assert cfg["model_type"] == hf.config.model_type and cfg["tie_word_embeddings"]
    ours = get_model_class(cfg["model_type"])(ModelInitParams(model_path=str(path), max_total_token_num=512))
    assert type(ours).__name__ == class_name
    if name == "gemma":
        assert_matches_hf_greedy(ours, hf, random_prompts([5, 9, 1], TINY["vocab_size"]), steps=8)
    else:
        assert [layer.sliding_window_ for layer in ours.layers_infer] == [
            8 if t == "sliding_attention" else 0 for t in hf.config.layer_types]
        assert_matches_hf_past_the_window(ours, hf, TINY["vocab_size"], steps=8)
