"""LlamaTpPartModel against HF transformers on tiny random-weight models of each Llama-family
architecture: prefill of a ragged batch plus 16 greedy decode steps, and the general
cached-plus-new forward (chunked prefill, mixed batches)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from parity_utils import (
    LOGITS_TOL, BatchDriver, assert_chunked_prefill_matches_hf, assert_matches_hf_greedy, build_tiny_hf_model, hf_and_ours,
    load_ours, random_prompts, rel_err,
)

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
            max_position_embeddings=256)

CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(**TINY, num_key_value_heads=2),
    "llama3-rope-scaling": lambda: LlamaConfig(**TINY, num_key_value_heads=2, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama-linear-rope": lambda: LlamaConfig(**TINY, num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "smollm2-like-tied": lambda: LlamaConfig(**TINY, num_key_value_heads=1, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "qwen2-bias": lambda: Qwen2Config(**TINY, num_key_value_heads=2),
    "mistral": lambda: MistralConfig(**TINY, num_key_value_heads=2, sliding_window=None),
    # sliding windows (in the attention kernels) that the prompts and decodes outgrow: every
    # layer's (Mistral v0.1), the layers from max_window_layers on (Qwen2's use_sliding_window)
    "mistral-window": lambda: MistralConfig(**TINY, num_key_value_heads=2, sliding_window=6),
    "qwen2-window": lambda: Qwen2Config(**TINY, num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
                                        max_window_layers=1),
}

PROMPT_LENS = [5, 12, 1, 9]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    return hf_and_ours(CONFIGS, request.param, tmp_path_factory)


def test_prefill_and_decode_match_hf(models):
    hf, ours = models
    assert_matches_hf_greedy(ours, hf, random_prompts(PROMPT_LENS, 512), steps=16)


def test_chunked_prefill_matches_full_prompt(models):
    """Prompt fed as 7 + 6 + 1 tokens on top of the cache: every position's logits equal HF's
    logits over the whole prompt (the general n_cached > 0, n_new > 1 case)."""
    hf, ours = models
    assert_chunked_prefill_matches_hf(ours, hf, random_prompts([14], 512, seed=2)[0], cuts=[7, 13])


def test_mixed_batch_decode_and_extend(models):
    """One forward where request 0 decodes one token while request 1 brings five more on top of
    its cache (what speculative verification does) matches running them separately."""
    hf, ours = models
    a, b = random_prompts([6, 8], 512, seed=3)
    extra = random_prompts([5], 512, seed=4)[0]
    with torch.no_grad():
        ref_a = hf(torch.tensor([a + [7]])).logits[0, -1].float()
        ref_b = hf(torch.tensor([b + extra])).logits[0, -5:].float()
    driver = BatchDriver(ours)
    driver.prefill([a, b])
    logits = driver.extend([[7], extra], return_all_logits=True)
    assert rel_err(logits[0].cpu(), ref_a) < LOGITS_TOL
    assert rel_err(logits[1:].cpu(), ref_b) < LOGITS_TOL
    driver.free()


def test_dynamic_ntk_rope_beyond_trained_context(tmp_path):
    cfg = LlamaConfig(**{**TINY, "max_position_embeddings": 16}, num_key_value_heads=2,
                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    hf = build_tiny_hf_model(cfg, tmp_path)
    ours = load_ours(tmp_path, max_seq_len=64)  # past the 16-token window, where NTK scaling kicks in
    assert_matches_hf_greedy(ours, hf, random_prompts([12], 512), steps=10)


def test_kv_pool_exhaustion_is_a_clear_error(models):
    from llmserve.common.mem_manager import KVCacheFullError

    _, ours = models
    driver = BatchDriver(ours)
    with pytest.raises(KVCacheFullError):
        driver.prefill([[1] * 200] * 11)   # 2200 tokens > 2048 slots
    assert ours.mem_manager.can_use_mem_size == ours.mem_manager.size
    driver.free()


def test_warm_up_leaves_the_pools_as_it_found_them(models, monkeypatch):
    """The start-up warm-up (the worker runs it on a GPU) runs prefill and mixed steps, and with
    --speculate verify steps, and gives back every slot and row; the model answers as before."""
    hf, ours = models
    monkeypatch.setattr(ours.params, "speculate", 3)
    slots, rows = ours.mem_manager.can_use_mem_size, ours.req_manager.can_use_req_size
    ours.warm_up(max_prefill_tokens=512)
    assert (ours.mem_manager.can_use_mem_size, ours.req_manager.can_use_req_size) == (slots, rows)
    # Enough tokens that the 90% greedy agreement asked of fp16/bf16 allows a near-tie (with 6
    # it allowed none, and a random bf16 model on an H100 has some).
    assert_matches_hf_greedy(ours, hf, random_prompts([3, 7, 12, 5], 512, seed=5), steps=4)
