"""Tensor parallelism at the logits level: two gloo ranks, each holding half the heads, half the
MLP and half of an odd-sized (so zero-padded) vocabulary, must produce HF's logits."""

from __future__ import annotations

import functools

import torch
from transformers import (BloomConfig, Gemma2Config, Gemma3TextConfig, LlamaConfig, MixtralConfig, Phi3Config, Qwen2MoeConfig,
                          Qwen3Config, Qwen3MoeConfig)

from parity_utils import BatchDriver, build_tiny_hf_model, load_ours, rel_err, tp2_logits

PROMPTS = [[5, 17, 300, 2, 9], [44] * 3, list(range(100, 111))]


def _driver(path: str, rank: int, world: int) -> BatchDriver:
    return BatchDriver(load_ours(path, tp_rank=rank, world_size=world, device="cpu", dtype=torch.float32))


def _check(config, tmp_path) -> None:
    hf = build_tiny_hf_model(config, tmp_path / "model")
    got = tp2_logits(functools.partial(_driver, str(tmp_path / "model")), PROMPTS, str(tmp_path / "logits.pt"))
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ref = hf(torch.tensor([prompt + [i + 1]])).logits[0].float()
            assert rel_err(got["prefill"][i], ref[-2]) < 1e-4
            assert rel_err(got["decode"][i], ref[-1]) < 1e-4


def test_llama_tp2_logits_match_hf_with_padded_vocab(tmp_path):
    _check(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=511), tmp_path)


def test_bloom_tp2_logits_match_hf_with_padded_vocab(tmp_path):
    _check(BloomConfig(hidden_size=128, n_head=4, n_layer=2, vocab_size=511), tmp_path)


def test_qwen3_tp2_logits_match_hf_with_padded_vocab(tmp_path):
    # q_norm / k_norm ([head_dim]) are whole on each rank; a head size that is not hidden / heads
    _check(Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=48, vocab_size=511, tie_word_embeddings=True), tmp_path)


def test_phi3_tp2_logits_match_hf_with_padded_vocab(tmp_path):
    # fused qkv_proj / gate_up_proj cut per rank; partial rotary (q/k rows reordered per head) and
    # LongRoPE, whose original context (8) the 11-token prompt outgrows
    _check(Phi3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=511, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      max_position_embeddings=64, original_max_position_embeddings=8, partial_rotary_factor=0.75,
                      rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(12)],
                                    "long_factor": [1.0 + 1.5 * i for i in range(12)]}), tmp_path)


def test_gemma2_tp2_logits_match_hf_with_padded_vocab(tmp_path):
    # post-norms after the row-parallel reductions, soft-caps, a window (4) the prompts outgrow
    _check(Gemma2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, vocab_size=511, sliding_window=4, query_pre_attn_scalar=24,
                        attn_logit_softcapping=5.0, final_logit_softcapping=10.0), tmp_path)


def test_gemma3_tp2_logits_match_hf_with_padded_vocab(tmp_path):
    _check(Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=511, sliding_window=4,
                            layer_types=["sliding_attention", "full_attention"]), tmp_path)
MOE_TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=511)


def test_moe_tp2_logits_match_hf(tmp_path):
    # every expert's gate / up cut by columns and down by rows, the router whole on each rank;
    # Mixtral, Qwen3-MoE with a dense layer, and Qwen2-MoE's shared expert and its sigmoid gate
    for i, config in enumerate([
        MixtralConfig(**MOE_TINY, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
        Qwen3MoeConfig(**MOE_TINY, head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=3, decoder_sparse_step=2),
        Qwen2MoeConfig(**MOE_TINY, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       num_experts=4, num_experts_per_tok=2),
    ]):
        (tmp_path / str(i)).mkdir()
        _check(config, tmp_path / str(i))
