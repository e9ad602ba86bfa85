"""A tiny random Qwen3 through a real server: what /info says of it, and prompt logprobs
(``/v1/completions`` with ``echo``) and greedy tokens equal to HF's on the same weights. The
tokenizer is SmolLM2's carrying a Hermes-style template, as Qwen3's own tokenizer carries its
template (``<tool_call>`` blocks), so the server must pick the tokenizer's template and read tool
calls with the ``hermes`` parser."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch
from transformers import Qwen3Config

from parity_utils import build_tiny_hf_model, hf_greedy_with_logits
from serving_utils import ServerProcess

HERMES_JINJA = os.path.join(os.path.dirname(__file__), "..", "..", "chat_template", "hermes_tools.jinja")
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm2_tokenizer):
    """(server, HF model, tokenizer): tied embeddings, a head size (32) that is not hidden / heads (16)."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=len(smollm2_tokenizer), max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=smollm2_tokenizer.eos_token_id,
                      bos_token_id=smollm2_tokenizer.bos_token_id)
    hf = build_tiny_hf_model(cfg, path)
    smollm2_tokenizer.save_pretrained(path)
    # Qwen3's releases keep their template in tokenizer_config.json (transformers 5 saves a file)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    with open(HERMES_JINJA) as f:
        config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"chat_template": f.read()}))
    # float32 wherever it runs (the GPU suite runs tests/models too): the comparisons are exact
    with ServerProcess(str(path), "--served-model-name", "qwen3", "--dtype", "float32") as server:
        yield server, hf, smollm2_tokenizer


def complete(server: ServerProcess, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={"model": "qwen3", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_info_names_the_family_its_template_and_tool_parser(qwen3):
    server, _, _ = qwen3
    info = httpx.get(server.url + "/info", timeout=10).json()
    assert info["model_type"] == "qwen3"
    assert info["chat_template"]["source"] == "tokenizer" and info["tool_call_parser"] == "hermes"


def test_prompt_logprobs_match_hf(qwen3):
    server, hf, tokenizer = qwen3
    ids = tokenizer(PROMPT).input_ids
    lp = complete(server, prompt=ids, max_tokens=0, echo=True, logprobs=1)["logprobs"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)


def test_greedy_tokens_match_hf(qwen3):
    server, hf, tokenizer = qwen3
    ids = tokenizer(PROMPT).input_ids
    tokens, _ = hf_greedy_with_logits(hf, ids, 8)
    choice = complete(server, prompt=ids, max_tokens=8, logprobs=0, ignore_eos=True)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in tokens]
