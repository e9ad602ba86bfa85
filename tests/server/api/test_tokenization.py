"""The tokenizer's routes and the small endpoints vLLM clients expect: /tokenize (TGI's body and
vLLM's), /detokenize, /tokenizer_info, /v1/models/{id}, /version, and /docs without a network."""

from __future__ import annotations

import re

import httpx
import pytest

from llmserve import __version__

TIMEOUT = httpx.Timeout(60.0)
TEXT = "The capital of France is Paris."


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=TIMEOUT)


def openai_error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["code"] == status
    return error["message"]


def test_vllm_tokenize_prompt(tiny_server, smollm2_tokenizer):
    r = post(tiny_server.url, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = smollm2_tokenizer(TEXT).input_ids
    assert body == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                    "token_strs": smollm2_tokenizer.convert_ids_to_tokens(ids)}
    # add_special_tokens=false, as lm-eval's remote tokenizer sends it
    special = "<|im_start|>" + TEXT
    r = post(tiny_server.url, "/tokenize", {"prompt": special, "add_special_tokens": False})
    assert r.json()["tokens"] == smollm2_tokenizer(special, add_special_tokens=False).input_ids
    assert r.json()["token_strs"] is None


def test_vllm_tokenize_messages_is_the_chat_prompt(tiny_server, smollm2_tokenizer):
    messages = [{"role": "user", "content": "Name a colour."}]
    r = post(tiny_server.url, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    text = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == smollm2_tokenizer(text, add_special_tokens=False).input_ids
    chat = post(tiny_server.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]
    r = post(tiny_server.url, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert "add_generation_prompt" in openai_error(r, 400, "add_generation_prompt")


def test_tgi_tokenize_body_still_answers_tgis_shape(tiny_server):
    r = post(tiny_server.url, "/tokenize", {"inputs": "Hello world"})
    assert r.status_code == 200, r.text
    tokens = r.json()
    assert "".join(t["text"] for t in tokens) == "Hello world"
    assert set(tokens[0]) == {"id", "text", "start", "stop"}
    r = post(tiny_server.url, "/tokenize", {"inputs": ""})
    assert r.status_code == 422 and set(r.json()) == {"error", "error_type"}
    r = post(tiny_server.url, "/tokenize", {"parameters": {}})          # neither API's body: TGI's error
    assert r.status_code == 422 and "inputs" in r.json()["error"]


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "hi", "model": "nope"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"prompt": "x" * (4 * 1024 * 1024 + 1)}, 400, "prompt"),
])
def test_vllm_tokenize_errors_are_openai_shaped(tiny_server, body, status, param):
    openai_error(post(tiny_server.url, "/tokenize", body), status, param)


def test_detokenize(tiny_server, smollm2_tokenizer):
    ids = smollm2_tokenizer(TEXT).input_ids
    r = post(tiny_server.url, "/detokenize", {"tokens": ids, "model": "tiny"})
    assert r.status_code == 200 and r.json() == {"prompt": smollm2_tokenizer.decode(ids)} == {"prompt": TEXT}
    assert "tokens" in openai_error(post(tiny_server.url, "/detokenize", {"tokens": [len(smollm2_tokenizer)]}), 400, "tokens")
    openai_error(post(tiny_server.url, "/detokenize", {"tokens": ["a"]}), 400, "tokens")
    openai_error(post(tiny_server.url, "/detokenize", {"tokens": [1], "model": "nope"}), 404, "model")


def test_tokenizer_info_and_lm_evals_probe(tiny_server, smollm2_tokenizer):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    info = httpx.get(tiny_server.url + "/tokenizer_info", timeout=TIMEOUT).json()
    assert info["eos_token"] == smollm2_tokenizer.eos_token and info["bos_token"] == smollm2_tokenizer.bos_token
    assert info["model_max_length"] == 512 and info["chat_template"] == smollm2_tokenizer.chat_template
    base_url = tiny_server.url + "/v1/completions"
    assert check_remote_tokenizer_support(base_url)
    remote = RemoteTokenizer(base_url)
    assert remote.eos_token_id == smollm2_tokenizer.eos_token_id
    assert remote.encode(TEXT) == smollm2_tokenizer(TEXT, add_special_tokens=False).input_ids
    assert remote.decode(remote.encode(TEXT)) == TEXT


def test_models_by_id(tiny_server):
    oai = tiny_server.openai_client()
    model = oai.models.retrieve("tiny")
    assert model.id == "tiny" and model.owned_by == "llmserve"
    assert httpx.get(tiny_server.url + "/v1/models/tiny", timeout=TIMEOUT).json() == \
        httpx.get(tiny_server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]
    message = openai_error(httpx.get(tiny_server.url + "/v1/models/nope", timeout=TIMEOUT), 404, "model")
    assert "nope" in message


def test_version(tiny_server):
    assert httpx.get(tiny_server.url + "/version", timeout=TIMEOUT).json() == {"version": __version__}


def test_docs_load_nothing_from_other_hosts(tiny_server):
    html = httpx.get(tiny_server.url + "/docs", timeout=TIMEOUT).text
    urls = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", html)
    assert {u for u in urls if "//" in u} == set(), urls           # no CDN, no other host
    assets = [u for u in urls if u.endswith((".js", ".css"))]
    assert len(assets) == 2
    for url in assets:
        r = httpx.get(tiny_server.url + url, timeout=TIMEOUT)
        assert r.status_code == 200 and len(r.content) > 100_000, url
    assert "/openapi.json" in urls
    paths = httpx.get(tiny_server.url + "/openapi.json", timeout=TIMEOUT).json()["paths"]
    assert {"/tokenize", "/detokenize", "/tokenizer_info", "/version", "/v1/models/{model_id}"} <= set(paths)


def test_openapi_refers_only_to_schemas_it_has(tiny_server):
    document = httpx.get(tiny_server.url + "/openapi.json", timeout=TIMEOUT).json()
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', str(document).replace("'", '"')))
    assert refs and refs <= set(document["components"]["schemas"]), refs - set(document["components"]["schemas"])
    [tgi_body, prompt_body, chat_body] = document["paths"]["/tokenize"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["oneOf"]
    assert "inputs" in tgi_body["properties"] and "prompt" in prompt_body["properties"]
    assert "messages" in chat_body["properties"]
