"""A tiny random Phi-3 through a real server: /info, prompt logprobs (``/v1/completions`` with
``echo``) and greedy tokens equal to HF's on the same weights, with LongRoPE whose original context
(8) the prompt outgrows and partial rotary (Phi-4-mini's shape). The tokenizer is SmolLM2's
carrying a Phi-3-style template in ``tokenizer_config.json``, as Phi-3's releases do, so the server
must serve the tokenizer's template."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import Phi3Config

from parity_utils import build_tiny_hf_model, hf_greedy_with_logits
from serving_utils import ServerProcess

PROMPT = "The quick brown fox jumps over the lazy dog"
PHI3_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, smollm2_tokenizer):
    """(server, HF model, tokenizer)"""
    path = tmp_path_factory.mktemp("tiny-phi3")
    tok = smollm2_tokenizer
    cfg = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                     original_max_position_embeddings=8, partial_rotary_factor=0.75, tie_word_embeddings=True,
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                   "long_factor": [1.0 + 1.5 * i for i in range(6)]},
                     pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    hf = build_tiny_hf_model(cfg, path)
    tok.save_pretrained(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"chat_template": PHI3_TEMPLATE}))
    with ServerProcess(str(path), "--served-model-name", "phi3", "--dtype", "float32") as server:
        yield server, hf, tok


def post(server: ServerProcess, route: str, **body) -> dict:
    r = httpx.post(server.url + route, timeout=60, json={"model": "phi3", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_info_names_the_family_and_the_tokenizers_template(phi3):
    server, _, _ = phi3
    info = httpx.get(server.url + "/info", timeout=10).json()
    assert info["model_type"] == "phi3" and info["chat_template"]["source"] == "tokenizer"


def test_prompt_logprobs_and_greedy_tokens_match_hf(phi3):
    server, hf, tokenizer = phi3
    ids = tokenizer(PROMPT).input_ids
    assert len(ids) > 8   # past the original context: the long factors
    lp = post(server, "/v1/completions", prompt=ids, max_tokens=0, echo=True, logprobs=1)["logprobs"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    tokens, _ = hf_greedy_with_logits(hf, ids, 8)
    choice = post(server, "/v1/completions", prompt=ids, max_tokens=8, logprobs=0, ignore_eos=True)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in tokens]


def test_chat_is_rendered_with_the_tokenizers_template(phi3):
    server, hf, tokenizer = phi3
    messages = [{"role": "user", "content": "hi"}]
    ids = tokenizer("<|user|>\nhi<|end|>\n<|assistant|>\n", add_special_tokens=False).input_ids
    tokens, _ = hf_greedy_with_logits(hf, ids, 4)
    choice = post(server, "/v1/chat/completions", messages=messages, max_tokens=4, ignore_eos=True)
    assert choice["message"]["content"] == tokenizer.decode(tokens)
