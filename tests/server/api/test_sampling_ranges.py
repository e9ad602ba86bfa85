"""A sampling number's range is written once (``SAMPLING_RULES``): change one rule, and TGI's
routes, OpenAI's routes, the offline LLM's SamplingParams and the defaults a model or a chat
template brings all refuse the same value.

The app runs in this process, over an engine that fails whatever reaches it: ranges are checked
at the edge, so a 424 (the engine's failure) says a value got past the edge, and a 422 / 400 that
it did not.
"""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from llmserve.chat_template import BaseTemplate
from llmserve.generation_config import SamplingDefaults
from llmserve.sampling_params import SAMPLING_RULES, InvalidRequest, SamplingParams, SamplingRule
from llmserve.server.api.app import create_app
from llmserve.server.api.state import ServerConfig, ServerState
from llmserve.server.metrics import ServerMetrics
from serving_utils import FailingEngine


@pytest.fixture(scope="module")
def app(tiny_llama_dir, smollm2_tokenizer):
    engine = FailingEngine(tiny_llama_dir, smollm2_tokenizer)
    state = ServerState(ServerConfig(generation_config="none"), engine, ServerMetrics())
    # not entered as a context manager: no lifespan, so no engine to start
    return TestClient(create_app(state)), engine


def tgi(client: TestClient, **parameters):
    return client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2, **parameters}})


def openai(client: TestClient, **fields):
    return client.post("/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})


def changed(name: str, **changes) -> SamplingRule:
    """SAMPLING_RULES[name] with its range changed."""
    rule = SAMPLING_RULES[name]
    return dataclasses.replace(rule, range=dataclasses.replace(rule.range, **changes))


def test_a_rule_changed_in_the_table_is_refused_everywhere(app, monkeypatch):
    client, engine = app
    # as the rules stand, top_p 0.7 gets past both edges (and the engine fails it)
    assert tgi(client, top_p=0.7).status_code == 424
    assert openai(client, top_p=0.7).status_code == 424
    assert [p.top_p for p in engine.received[-2:]] == [0.7, 0.7]
    SamplingParams(top_p=0.7)

    monkeypatch.setitem(SAMPLING_RULES, "top_p", changed("top_p", high=0.5))
    r = tgi(client, top_p=0.7)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "`top_p` must be in (0, 0.5)" in r.json()["error"]          # TGI's open end follows the rule
    r = openai(client, top_p=0.7)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    assert "top_p must be in (0, 0.5]" in r.json()["error"]["message"]
    with pytest.raises(InvalidRequest, match=r"top_p must be in \(0, 0.5\]"):
        SamplingParams(top_p=0.7)                                       # what the offline LLM is given
    with pytest.raises(ValueError, match="top_p"):
        SamplingDefaults(top_p=0.7, source="a generation_config.json")
    with pytest.raises(ValueError, match="top_p"):
        BaseTemplate(top_p=0.7)
    # inside the changed rule, a value still gets through
    assert tgi(client, top_p=0.4).status_code == 424 and openai(client, top_p=0.4).status_code == 424


def test_an_apis_narrower_range_stays_its_own(app, monkeypatch):
    """OpenAI caps temperature at 2 and TGI refuses 0 (seed 004); the engine's range is >= 0."""
    client, _ = app
    SamplingParams(temperature=3)
    assert tgi(client, temperature=3, do_sample=True).status_code == 424
    r = openai(client, temperature=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert tgi(client, temperature=0, do_sample=True).status_code == 422
    assert openai(client, temperature=0).status_code == 424

    monkeypatch.setitem(SAMPLING_RULES, "temperature", changed("temperature", high=1.5))
    r = tgi(client, temperature=1.7, do_sample=True)
    assert r.status_code == 422 and "`temperature` must be in (0, 1.5]" in r.json()["error"]
    r = openai(client, temperature=1.7)
    assert r.status_code == 400 and "temperature must be in [0, 1.5]" in r.json()["error"]["message"]
