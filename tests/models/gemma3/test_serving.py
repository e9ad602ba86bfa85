"""A tiny random Gemma 3 (text) through a real server: prompt logprobs (``/v1/completions`` with
``echo``) within 1e-4 of HF's for a prompt past its sliding window (8 tokens) and prefill chunk
(16), greedy tokens equal, and /info."""

from __future__ import annotations

import httpx
import pytest
from transformers import Gemma3TextConfig

from parity_utils import build_tiny_hf_model, hf_greedy_with_logits, hf_prompt_logprobs
from serving_utils import ServerProcess, greedy_completion

PROMPT = ("The quick brown fox jumps over the lazy dog, and then the dog, who is not lazy at all, "
          "chases the fox around the farm")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smollm2_tokenizer):
    """(server, HF model, tokenizer): two sliding layers to one global, linear scaling on the global one."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, vocab_size=len(smollm2_tokenizer),
                           max_position_embeddings=512, sliding_window=8, query_pre_attn_scalar=24,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1_000_000.0}},
                           eos_token_id=smollm2_tokenizer.eos_token_id, bos_token_id=smollm2_tokenizer.bos_token_id,
                           pad_token_id=smollm2_tokenizer.eos_token_id)
    hf = build_tiny_hf_model(cfg, path)
    smollm2_tokenizer.save_pretrained(path)
    with ServerProcess(str(path), "--served-model-name", "gemma3", "--dtype", "float32",
                       "--max-batch-prefill-tokens", "16") as server:
        yield server, hf, smollm2_tokenizer


def complete(server: ServerProcess, **body) -> dict:
    return greedy_completion(server, "gemma3", **body)


def test_info_names_the_family(gemma3):
    server, _, _ = gemma3
    assert httpx.get(server.url + "/info", timeout=10).json()["model_type"] == "gemma3_text"


def test_prompt_logprobs_match_hf(gemma3):
    server, hf, tokenizer = gemma3
    ids = tokenizer(PROMPT).input_ids
    assert len(ids) > 16
    lp = complete(server, prompt=ids, max_tokens=0, echo=True, logprobs=1)["logprobs"]
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(hf_prompt_logprobs(hf, ids), abs=1e-4)


def test_greedy_tokens_match_hf(gemma3):
    server, hf, tokenizer = gemma3
    ids = tokenizer(PROMPT).input_ids
    tokens, _ = hf_greedy_with_logits(hf, ids, 12)
    choice = complete(server, prompt=ids, max_tokens=12, logprobs=0, ignore_eos=True)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in tokens]
