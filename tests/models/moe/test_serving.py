"""Tiny random Mixtral and Qwen3-MoE through a real server each: what /info says of them, and
prompt logprobs (``/v1/completions`` with ``echo``) and greedy tokens equal to HF's on the same
weights. The tokenizer is SmolLM2's. The Mixtral directory ships no template and is named as an
instruct release, so the server matches the registry's ``mistral`` template and parser by name;
the Qwen3-MoE one carries a Hermes-style template in ``tokenizer_config.json``, as Qwen3's
releases do, so the server serves it and reads tool calls with the ``hermes`` parser."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig

from parity_utils import build_tiny_hf_model, hf_greedy_with_logits
from serving_utils import ServerProcess

HERMES_JINJA = os.path.join(os.path.dirname(__file__), "..", "..", "chat_template", "hermes_tools.jinja")
PROMPT = "The quick brown fox jumps over the lazy dog"
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512)
FAMILIES = {
    # name: (directory, config, (chat template source, name), tool-call parser)
    "mixtral": ("tiny-mixtral-8x7b-instruct",
                lambda **kw: MixtralConfig(**TINY, **kw, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
                ("matched", "mistral"), "mistral"),
    "qwen3_moe": ("tiny-qwen3-moe",
                  lambda **kw: Qwen3MoeConfig(**TINY, **kw, head_dim=32, moe_intermediate_size=32, num_experts=8,
                                              num_experts_per_tok=2, norm_topk_prob=True),
                  ("tokenizer", None), "hermes"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory, smollm2_tokenizer):
    """(family, server, HF model, tokenizer)"""
    family = request.param
    directory, config, template, _ = FAMILIES[family]
    tok = smollm2_tokenizer
    path = tmp_path_factory.mktemp("moe") / directory
    hf = build_tiny_hf_model(config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id),
                             path)
    tok.save_pretrained(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    tok_config = {k: v for k, v in json.loads(config_file.read_text()).items() if k != "chat_template"}
    if template[0] == "tokenizer":
        with open(HERMES_JINJA) as f:
            tok_config["chat_template"] = f.read()
    config_file.write_text(json.dumps(tok_config))
    # float32 wherever it runs (the GPU suite runs tests/models too): the comparisons are exact
    with ServerProcess(str(path), "--served-model-name", family, "--dtype", "float32") as server:
        yield family, server, hf, tok


def complete(family: str, server: ServerProcess, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={"model": family, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_info_names_the_family_its_template_and_tool_parser(served):
    family, server, _, _ = served
    _, _, (source, name), parser = FAMILIES[family]
    info = httpx.get(server.url + "/info", timeout=10).json()
    assert info["model_type"] == family and info["tool_call_parser"] == parser
    assert info["chat_template"]["source"] == source and (name is None or info["chat_template"]["name"] == name)


def test_prompt_logprobs_and_greedy_tokens_match_hf(served):
    family, server, hf, tokenizer = served
    ids = tokenizer(PROMPT).input_ids
    lp = complete(family, server, prompt=ids, max_tokens=0, echo=True, logprobs=1)["logprobs"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    tokens, _ = hf_greedy_with_logits(hf, ids, 8)
    choice = complete(family, server, prompt=ids, max_tokens=8, logprobs=0, ignore_eos=True)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in tokens]
