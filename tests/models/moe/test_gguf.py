"""Mixture-of-experts GGUF files, written as llama.cpp's converter writes them (gguf-py's own tensor
names; each projection's experts stacked in one tensor; Mixtral as the ``llama`` architecture with
an expert count), read into our MoE classes give HF's logits and greedy tokens on the same weights."""

from __future__ import annotations

import gguf
import pytest
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from gguf_utils import checkpoint_tensors, write_converted_gguf
from parity_utils import assert_matches_hf_greedy, build_tiny_hf_model, random_prompts

from llmserve.common.basemodel import ModelInitParams
from llmserve.models.registry import get_model_class, peek_model_config

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=256)


def _experts_kv(config):
    def write(w: gguf.GGUFWriter) -> None:
        w.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        if hasattr(config, "moe_intermediate_size"):
            w.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    return write


# name -> (HF config, our class); what the GGUF metadata can say: every layer has experts, and
# llama.cpp renormalises Qwen3-MoE's top-k weights (and not Qwen2-MoE's)
CASES = {
    "mixtral": (lambda: MixtralConfig(**TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
                "MixtralTpPartModel"),
    "qwen2-moe": (lambda: Qwen2MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=48),
                  "Qwen2MoeTpPartModel"),
    "qwen3-moe": (lambda: Qwen3MoeConfig(**TINY, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
                  "Qwen3MoeTpPartModel"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_gguf_matches_hf(tmp_path, name):
    make_config, class_name = CASES[name]
    hf = build_tiny_hf_model(make_config(), tmp_path / "hf")
    path = tmp_path / f"tiny-{name}.gguf"
    write_converted_gguf(path, hf.config, checkpoint_tensors(tmp_path / "hf"), extra_kv=_experts_kv(hf.config))

    cfg = peek_model_config(str(path))
    assert cfg["model_type"] == hf.config.model_type
    ours = get_model_class(cfg["model_type"])(ModelInitParams(model_path=str(path), max_total_token_num=256))
    assert type(ours).__name__ == class_name
    assert_matches_hf_greedy(ours, hf, random_prompts([5, 9, 1], TINY["vocab_size"]), steps=8)
