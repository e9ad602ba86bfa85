"""A tiny random Gemma 2 through a real server, with a sliding window (8 tokens) its prompts
outgrow, prefill chunks of 16 tokens and the prefix cache on: prompt logprobs (``/v1/completions``
with ``echo``) within 1e-4 of HF's, greedy tokens and their logprobs equal HF's also for a prompt
whose first part is served from the prefix cache, and /info. The checkpoint ships no chat template and its directory
is named like an instruction-tuned Gemma, so the server matches the built-in ``gemma`` one."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import Gemma2Config

from parity_utils import build_tiny_hf_model, hf_greedy_with_logits, hf_prompt_logprobs
from serving_utils import ServerProcess, greedy_completion

PROMPT = ("The quick brown fox jumps over the lazy dog, and then the dog, who is not lazy at all, "
          "chases the fox around the farm until both of them are tired")


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, smollm2_tokenizer):
    """(server, HF model, tokenizer)."""
    path = tmp_path_factory.mktemp("models") / "tiny-gemma-2-it"
    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=len(smollm2_tokenizer), max_position_embeddings=512,
                       sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                       eos_token_id=smollm2_tokenizer.eos_token_id, bos_token_id=smollm2_tokenizer.bos_token_id,
                       pad_token_id=smollm2_tokenizer.eos_token_id)
    hf = build_tiny_hf_model(cfg, path)
    smollm2_tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    with ServerProcess(str(path), "--served-model-name", "gemma2", "--dtype", "float32",
                       "--max-batch-prefill-tokens", "16") as server:
        yield server, hf, smollm2_tokenizer


def complete(server: ServerProcess, **body) -> dict:
    return greedy_completion(server, "gemma2", **body)


def test_info_names_the_family_and_its_template(gemma2):
    server, _, _ = gemma2
    info = httpx.get(server.url + "/info", timeout=10).json()
    assert info["model_type"] == "gemma2"
    assert info["chat_template"]["name"] == "gemma" and info["chat_template"]["source"] == "matched"


def test_prompt_logprobs_past_the_window_match_hf(gemma2):
    """A prompt several windows and prefill chunks long."""
    server, hf, tokenizer = gemma2
    ids = tokenizer(PROMPT).input_ids
    assert len(ids) > 2 * 16
    lp = complete(server, prompt=ids, max_tokens=0, echo=True, logprobs=1)["logprobs"]
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(hf_prompt_logprobs(hf, ids), abs=1e-4)


def test_prefix_cache_hit_past_the_window_matches_hf(gemma2):
    """The prompt, then the prompt with a tail: the second's first part comes from the prefix
    cache (keys rotated and stored by the first), only the rest is computed over them; its greedy
    tokens and their logprobs are HF's over the whole prompt."""
    server, hf, tokenizer = gemma2
    ids = tokenizer(PROMPT).input_ids
    complete(server, prompt=ids, max_tokens=1)
    hits = server.metrics().get("llmserve_prefix_cache_hit_tokens_total", 0.0)
    prompt = ids + tokenizer(" and the farmer laughs").input_ids
    choice = complete(server, prompt=prompt, max_tokens=6, logprobs=0, ignore_eos=True)
    assert server.metrics()["llmserve_prefix_cache_hit_tokens_total"] >= hits + 16
    tokens, logits = hf_greedy_with_logits(hf, prompt, 6)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in tokens]
    expected = [torch.log_softmax(row, -1)[t].item() for row, t in zip(logits, tokens)]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)


def test_greedy_tokens_match_hf(gemma2):
    server, hf, tokenizer = gemma2
    ids = tokenizer(PROMPT).input_ids
    tokens, _ = hf_greedy_with_logits(hf, ids, 12)
    choice = complete(server, prompt=ids, max_tokens=12, logprobs=0, ignore_eos=True)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in tokens]


def test_chat_renders_gemma_turns(gemma2):
    server, _, tokenizer = gemma2
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "gemma2", "max_tokens": 2, "messages": [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    expected = tokenizer("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n").input_ids
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
