"""A Qwen3 GGUF file (llama.cpp's ``qwen3`` architecture: q/k norms as ``blk.N.attn_q_norm`` /
``attn_k_norm``, q and k not permuted, the head size in ``attention.key_length``) read into
Qwen3TpPartModel gives HF's logits and greedy tokens on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from gguf_utils import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, write_gguf
from parity_utils import assert_matches_hf_greedy, build_tiny_hf_model, random_prompts

from llmserve.common.basemodel import ModelInitParams
from llmserve.models.registry import get_model_class, peek_model_config

HEAD_DIM = 16     # not HIDDEN / HEADS (8)


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_gguf_matches_hf(tmp_path, tied):
    config = Qwen3Config(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB, max_position_embeddings=128,
                         rms_norm_eps=1e-6, tie_word_embeddings=tied)
    hf = build_tiny_hf_model(config, tmp_path / "hf")
    state = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf(path, "qwen3", {k: v.numpy() for k, v in state.items()}, head_dim=HEAD_DIM)

    cfg = peek_model_config(str(path))
    assert (cfg["model_type"], cfg["head_dim"], cfg["tie_word_embeddings"]) == ("qwen3", HEAD_DIM, tied)
    ours = get_model_class(cfg["model_type"])(ModelInitParams(model_path=str(path), max_total_token_num=256))
    assert type(ours).__name__ == "Qwen3TpPartModel"
    assert_matches_hf_greedy(ours, hf, random_prompts([5, 9, 1], VOCAB), steps=8)
