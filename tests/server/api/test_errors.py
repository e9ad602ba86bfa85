"""Bad input, end to end: every malformed or out-of-range request gets a 4xx with a message that
says what is wrong, in the shape its route family's clients read, and the server carries on
serving (the next good request succeeds on the same server).

TGI routes answer ``422 {"error": str, "error_type": "validation"}``; OpenAI routes answer
``400``/``404 {"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import text_generation
from text_generation.errors import ValidationError as TGIValidationError

TIMEOUT = httpx.Timeout(60.0)

LONG_PROMPT = "hi " * 600        # > the tiny model's 512 positions
NEAR_LIMIT_PROMPT = "hi " * 500  # fits as a prompt, not with 100 new tokens on top


def post(url: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    return httpx.post(url + path, json=body, timeout=TIMEOUT)


def assert_serves(url: str) -> None:
    """The server is still fine: a good TGI request and a good OpenAI request both succeed."""
    r = post(url, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "details": True}})
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] == 2
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


# -- TGI ---------------------------------------------------------------------------------

TGI_CASES = {
    # name: (path, body, words the message must contain)
    "malformed_json": ("/generate", b'{"inputs": "hi", "parameters": {', ["not valid JSON"]),
    "missing_inputs": ("/generate", {"parameters": {"max_new_tokens": 2}}, ["inputs", "required"]),
    "empty_inputs": ("/generate", {"inputs": ""}, ["inputs", "empty"]),
    "zero_max_new_tokens": ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 0}}, ["max_new_tokens", "positive"]),
    "negative_max_new_tokens": ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": -5}}, ["max_new_tokens", "positive"]),
    "sampling_temperature_zero": ("/generate", {"inputs": "hi", "parameters": {"do_sample": True, "temperature": 0}},
                                  ["temperature", "positive"]),
    "top_p_over_one": ("/generate", {"inputs": "hi", "parameters": {"top_p": 1.5}}, ["top_p"]),
    "prompt_over_limit": ("/generate", {"inputs": LONG_PROMPT}, ["inputs", "512", "tokens"]),
    "prompt_plus_new_over_limit": ("/generate", {"inputs": NEAR_LIMIT_PROMPT, "parameters": {"max_new_tokens": 100}},
                                   ["max_new_tokens", "512"]),
    "max_new_tokens_not_int": ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": "abc"}},
                               ["max_new_tokens", "integer"]),
    "inputs_not_str": ("/generate", {"inputs": 5}, ["inputs", "string"]),
    "parameters_not_object": ("/generate", {"inputs": "hi", "parameters": [1, 2]}, ["parameters"]),
    "adapter_id": ("/generate", {"inputs": "hi", "parameters": {"adapter_id": "my-lora"}}, ["adapter", "my-lora"]),
    "stream_decoder_input_details": ("/generate_stream", {"inputs": "hi", "parameters": {"decoder_input_details": True}},
                                     ["decoder_input_details", "stream"]),
    "stream_zero_max_new_tokens": ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 0}},
                                   ["max_new_tokens"]),
    "stream_malformed_json": ("/generate_stream", b"not json at all", ["not valid JSON"]),
    "compat_route_top_p": ("/", {"inputs": "hi", "parameters": {"top_p": 0}}, ["top_p"]),
}


@pytest.mark.parametrize("case", list(TGI_CASES))
def test_tgi_bad_input_gets_422_then_server_serves(tiny_server, case):
    path, body, words = TGI_CASES[case]
    r = post(tiny_server.url, path, body)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/json")
    payload = r.json()
    assert set(payload) == {"error", "error_type"}, payload
    assert payload["error_type"] == "validation"
    assert isinstance(payload["error"], str) and "\n" not in payload["error"]
    for word in words:
        assert word.lower() in payload["error"].lower(), (word, payload["error"])
    assert_serves(tiny_server.url)


def test_bad_input_is_counted_and_leaves_no_state(tiny_server):
    before = tiny_server.metrics()
    for path, body, _ in TGI_CASES.values():
        assert post(tiny_server.url, path, body).status_code == 422
    after = tiny_server.metrics()
    key = 'llmserve_requests_total{outcome="validation_error"}'
    assert after[key] - before[key] == len(TGI_CASES)
    assert after["llmserve_requests_in_flight"] == 0
    assert after["llmserve_kv_cache_slots_used"] == 0
    assert after["llmserve_queue_size"] == 0


# -- OpenAI ------------------------------------------------------------------------------

USER_HI = [{"role": "user", "content": "hi"}]

OPENAI_CASES = {
    # name: (path, body, status, type, param, words the message must contain)
    "completions_unknown_model": ("/v1/completions", {"model": "no-such-model", "prompt": "hi"},
                                  404, "not_found_error", "model", ["no-such-model", "does not exist"]),
    "chat_unknown_model": ("/v1/chat/completions", {"model": "no-such-model", "messages": USER_HI},
                           404, "not_found_error", "model", ["no-such-model", "does not exist"]),
    "temperature_3": ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 3},
                      400, "invalid_request_error", "temperature", ["temperature"]),
    "chat_temperature_3": ("/v1/chat/completions", {"model": "tiny", "messages": USER_HI, "temperature": 3},
                           400, "invalid_request_error", "temperature", ["temperature"]),
    "n_0": ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, 400, "invalid_request_error", "n", ["n must"]),
    "chat_n_0": ("/v1/chat/completions", {"model": "tiny", "messages": USER_HI, "n": 0},
                 400, "invalid_request_error", "n", ["n must"]),
    "messages_empty": ("/v1/chat/completions", {"model": "tiny", "messages": []},
                       400, "invalid_request_error", "messages", ["messages"]),
    "messages_missing": ("/v1/chat/completions", {"model": "tiny"},
                         400, "invalid_request_error", "messages", ["messages", "required"]),
    "unknown_content_part": ("/v1/chat/completions",
                             {"model": "tiny", "messages": [{"role": "user", "content": [
                                 {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}]},
                             400, "invalid_request_error", "messages", ["image_url", "not supported"]),
    "completions_logprobs_21": ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 21},
                                400, "invalid_request_error", "logprobs", ["logprobs", "20"]),
    "completions_logprobs_negative": ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": -1},
                                      400, "invalid_request_error", "logprobs", ["logprobs"]),
    "chat_top_logprobs_21": ("/v1/chat/completions", {"model": "tiny", "messages": USER_HI, "logprobs": True, "top_logprobs": 21},
                             400, "invalid_request_error", "top_logprobs", ["top_logprobs", "20"]),
    "max_tokens_0": ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0},
                     400, "invalid_request_error", "max_tokens", ["max_tokens"]),
    "prompt_over_limit": ("/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT},
                          400, "invalid_request_error", "prompt", ["512", "tokens"]),
    "prompt_missing": ("/v1/completions", {"model": "tiny"}, 400, "invalid_request_error", "prompt", ["prompt", "required"]),
    "malformed_json": ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, "invalid_request_error", None,
                       ["not valid JSON"]),
}


@pytest.mark.parametrize("case", list(OPENAI_CASES))
def test_openai_bad_input_gets_openai_error_then_server_serves(tiny_server, case):
    path, body, status, error_type, param, words = OPENAI_CASES[case]
    r = post(tiny_server.url, path, body)
    assert r.status_code == status, r.text
    payload = r.json()
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == error_type
    assert error["param"] == param
    assert error["code"] == status
    assert isinstance(error["message"], str) and "\n" not in error["message"]
    for word in words:
        assert word.lower() in error["message"].lower(), (word, error["message"])
    assert_serves(tiny_server.url)


# -- the clients people use --------------------------------------------------------------

def test_text_generation_client_raises_validation_error(tiny_server):
    client = text_generation.Client(tiny_server.url, timeout=60)
    with pytest.raises(TGIValidationError, match="max_new_tokens"):
        client.generate("hi", max_new_tokens=0)
    with pytest.raises(TGIValidationError, match="tokens"):
        client.generate(LONG_PROMPT, max_new_tokens=2)
    with pytest.raises(TGIValidationError, match="tokens"):
        next(iter(client.generate_stream(LONG_PROMPT, max_new_tokens=2)))
    assert client.generate("Hello", max_new_tokens=2).details.generated_tokens == 2


def test_openai_sdk_raises_bad_request_and_not_found(tiny_server):
    client = tiny_server.openai_client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404 and "no-such-model" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=USER_HI, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER_HI, temperature=3, max_tokens=2)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", n=0, max_tokens=2)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    assert e.value.param == "messages"
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
