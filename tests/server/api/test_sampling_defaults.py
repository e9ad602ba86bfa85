"""The model's recommended sampling values (its generation_config.json) fill what a request
leaves unset, on both APIs, and /info and the start-up line say which apply."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from llmserve.generation_config import GENERATION_CONFIG_FILE
from serving_utils import ServerProcess

RECOMMENDED = {"temperature": 0.5, "top_k": 7, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    folder = tmp_path_factory.mktemp("tiny-with-config") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    with open(folder / GENERATION_CONFIG_FILE) as f:
        saved = json.load(f)       # the token ids save_pretrained wrote stay
    with open(folder / GENERATION_CONFIG_FILE, "w") as f:
        json.dump(saved | RECOMMENDED, f)
    with ServerProcess(str(folder), "--served-model-name", "tiny") as server:
        server.model_dir = str(folder)
        yield server


def post(server: ServerProcess, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_info_and_the_start_up_line_report_the_defaults(server):
    info = httpx.get(server.url + "/info", timeout=30).json()
    assert info["generation_config"] == {
        "temperature": 0.5, "top_p": None, "top_k": 7, "typical_p": None, "repetition_penalty": 1.3,
        "source": os.path.join(server.model_dir, GENERATION_CONFIG_FILE),
    }
    assert "sampling defaults: temperature=0.5, top_k=7, repetition_penalty=1.3" in server.output()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "seed": 5}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}],
                              "max_tokens": 12, "seed": 5}),
])
def test_openai_unset_fields_take_the_models_values(server, path, body):
    by_default = post(server, path, body)["choices"][0]
    explicit = post(server, path, body | RECOMMENDED)["choices"][0]
    api_default = post(server, path, body | {"temperature": 1.0, "top_k": -1, "repetition_penalty": 1.0})["choices"][0]
    assert by_default == explicit
    assert by_default != api_default      # the defaults did change something


def test_tgi_sampling_takes_the_models_values_and_greedy_stays_greedy(server):
    prompt = "Once upon a time"
    sampled = post(server, "/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 12, "do_sample": True,
                                                                          "seed": 5}})
    explicit = post(server, "/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 12, "seed": 5,
                                                                           **RECOMMENDED}})
    assert sampled["generated_text"] == explicit["generated_text"]
    # TGI's default is greedy: the model's temperature does not make it sample, while its
    # repetition_penalty (which greedy decoding uses too) applies.
    greedy = post(server, "/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 12}})
    penalised = post(server, "/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 12,
                                                                            "repetition_penalty": 1.3}})
    assert greedy["generated_text"] == penalised["generated_text"]
