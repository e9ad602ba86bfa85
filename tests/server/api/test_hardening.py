"""Client input that used to crash, stall or starve the server (issue 9), through a real server.

Each case checks the status and the API's error shape, then that a good request still
succeeds on the same server.
"""

from __future__ import annotations

import json

import httpx
import pytest

from llmserve.server.api.schema import MAX_INPUT_CHARS, MAX_STOP_LENGTH, MAX_STOP_SEQUENCES, MAX_STOP_TOTAL_CHARS

TIMEOUT = httpx.Timeout(120.0)
USER_HI = [{"role": "user", "content": "hi"}]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=TIMEOUT)


def info(url: str) -> dict:
    return httpx.get(url + "/info", timeout=TIMEOUT).json()


def assert_serves(url: str) -> None:
    """The server is healthy and still answers a good TGI and a good OpenAI request."""
    assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
    r = post(url, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "details": True}})
    assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 2, r.text
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def raw(url: str, path: str, text: str) -> httpx.Response:
    """POST a JSON body written by hand (``Infinity``, ``1e999``, ``\\ud800`` escapes, ...)."""
    return httpx.post(url + path, content=text.encode(), headers={"content-type": "application/json"}, timeout=TIMEOUT)


def assert_tgi_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"}, body
    for word in words:
        assert word.lower() in body["error"].lower(), (word, body["error"])


def assert_openai_error(r: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param, body
    assert body["error"]["code"] == status
    for word in words:
        assert word.lower() in body["error"]["message"].lower(), (word, body["error"]["message"])


# -- 1. a huge top_k reached the sampler and overflowed int64, killing the engine ---------

HUGE = 2**63


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 5, "top_k": HUGE, "temperature": 0.8, "seed": 3}),
    # seed 004 bounds TGI's top_k by 2^31-1, still far beyond any vocabulary
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 5, "top_k": 2**31 - 1, "do_sample": True, "seed": 3}}),
    ("/v1/chat/completions", {"model": "tiny", "messages": USER_HI, "max_tokens": 5, "top_k": HUGE,
                              "temperature": 0.8, "seed": 3}),
])
def test_huge_top_k_cuts_nothing_and_the_server_lives(tiny_server, path, body):
    """top_k of the vocabulary or more is no cut at all: the same seeded text as without it."""
    r = post(tiny_server.url, path, body)
    assert r.status_code == 200, r.text
    without = {k: v for k, v in body.items() if k != "top_k"}
    if "parameters" in body:
        without["parameters"] = {k: v for k, v in body["parameters"].items() if k != "top_k"}
    assert answer(post(tiny_server.url, path, without)) == answer(r)
    assert_serves(tiny_server.url)


def answer(r: httpx.Response) -> str:
    body = r.json()
    if "generated_text" in body:
        return body["generated_text"]
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_float_top_k_is_refused_on_a_streaming_chat(tiny_server):
    r = raw(tiny_server.url, "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": true, "top_k": 1e20}')
    assert_openai_error(r, 400, "top_k", "integer")
    assert_serves(tiny_server.url)


# -- 2. one request fanned out without bound ----------------------------------------------

def test_prompt_list_times_n_beyond_the_concurrency_limit_is_refused_before_tokenizing(tiny_server):
    limit = info(tiny_server.url)["max_concurrent_requests"]
    r = post(tiny_server.url, "/v1/completions", {"model": "tiny", "prompt": [[1, 2]] * 3000, "max_tokens": 1})
    assert_openai_error(r, 400, "prompt", "3000 generations", str(limit))
    r = post(tiny_server.url, "/v1/completions", {"model": "tiny", "prompt": ["hi"] * 2000, "n": 128, "max_tokens": 1})
    assert_openai_error(r, 400, "prompt", "256000 generations")
    r = post(tiny_server.url, "/v1/chat/completions", {"model": "tiny", "messages": USER_HI, "n": 129})
    assert r.status_code == 400
    assert tiny_server.metrics()["llmserve_requests_in_flight"] == 0
    assert_serves(tiny_server.url)


def test_each_generation_holds_a_concurrency_slot(tiny_server):
    """A streaming request with n choices holds n slots while it runs: another request that
    would exceed the limit gets a 429, and the slots come back when the stream ends."""
    limit = info(tiny_server.url)["max_concurrent_requests"]
    big = {"model": "tiny", "prompt": "Once upon a time", "n": limit - 2, "max_tokens": 400, "ignore_eos": True,
           "stream": True, "temperature": 0}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=big, timeout=TIMEOUT) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()      # kept: a dropped iterator closes the connection
        next(lines)                      # the request is admitted and running
        assert tiny_server.metrics()["llmserve_requests_in_flight"] == limit - 2
        r = post(tiny_server.url, "/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 1})
        assert_openai_error(r, 429, None)
        r = post(tiny_server.url, "/v1/completions", {"model": "tiny", "prompt": "a", "n": 2, "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert_serves(tiny_server.url)
    assert tiny_server.metrics()["llmserve_requests_in_flight"] == 0


# -- 3. lone surrogates and malformed content parts gave 500s -----------------------------

@pytest.mark.parametrize("path, body, api, param", [
    ("/generate", '{"inputs": "ab\\ud800cd"}', "tgi", None),
    ("/tokenize", '{"inputs": "ab\\udfffcd"}', "tgi", None),
    ("/generate", '{"inputs": "hi", "parameters": {"stop": ["x\\ud800"]}}', "tgi", None),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "ab\\ud800cd"}]}',
     "openai", "messages"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "\\ud800"}]}]}', "openai", "messages"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udc00"]}', "openai", "prompt"),
    # in a key: the error message must not carry the surrogate itself (it could not be encoded)
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi", "\\udc00x": 1}]}',
     "openai", "messages"),
])
def test_lone_surrogates_are_refused(tiny_server, path, body, api, param):
    r = raw(tiny_server.url, path, body)
    if api == "tgi":
        assert_tgi_error(r, 422, "surrogate")
    else:
        assert_openai_error(r, 400, param, "surrogate")
    assert_serves(tiny_server.url)


@pytest.mark.parametrize("depth", [50, 950, 5000])
def test_deeply_nested_values_are_a_client_error(tiny_server, depth):
    """As deep as the JSON parser goes (and deeper): a 400 / 422, never a 500 from a recursion limit
    (Python 3.12's parser goes deeper than 3.11's, past the room left for recursing validators)."""
    nested = "[" * depth + "]" * depth
    r = raw(tiny_server.url, "/v1/completions", '{"model": %s, "prompt": "hi"}' % nested)
    assert r.status_code == 400, r.text
    r = raw(tiny_server.url, "/generate", '{"inputs": "hi", "parameters": {"stop": %s}}' % nested)
    assert r.status_code == 422, r.text
    assert_serves(tiny_server.url)


def test_a_surrogate_pair_is_a_character_like_any_other(tiny_server):
    r = raw(tiny_server.url, "/tokenize", '{"inputs": "smile \\ud83d\\ude00"}')
    assert r.status_code == 200, r.text
    tokens = r.json()
    assert tokens[-1]["text"] == "\U0001F600" and tokens[-1]["stop"] == len("smile \U0001F600")


def test_text_part_without_text_is_a_400(tiny_server):
    r = post(tiny_server.url, "/v1/chat/completions",
             {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert_openai_error(r, 400, "messages", "text")
    assert_serves(tiny_server.url)


# -- 4. huge inputs were tokenized whole before their length was checked ------------------

def test_a_long_input_is_refused_by_its_head(tiny_server):
    """600k characters for a 511-token limit: refused after tokenizing a few thousand of them
    (the message says "more than", which only the head check writes)."""
    text = "hello " * 100_000
    assert_tgi_error(post(tiny_server.url, "/generate", {"inputs": text}), 422, "inputs", "more than")
    assert_tgi_error(post(tiny_server.url, "/tokenize", {"inputs": text}), 422, "inputs", "more than")
    r = post(tiny_server.url, "/v1/completions", {"model": "tiny", "prompt": text})
    assert_openai_error(r, 400, "prompt", "more than")
    r = post(tiny_server.url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}]})
    assert_openai_error(r, 400, "messages", "more than")
    assert_serves(tiny_server.url)


def test_more_than_the_seeds_4mb_of_characters_is_refused(tiny_server):
    r = post(tiny_server.url, "/generate", {"inputs": "a" * (MAX_INPUT_CHARS + 1), "parameters": {"truncate": 4}})
    assert r.status_code in (413, 422), r.text
    assert set(r.json()) == {"error", "error_type"}
    assert_serves(tiny_server.url)


def test_truncate_keeps_the_last_tokens_of_a_long_input(tiny_server):
    """truncate cuts rather than refuses, so the head check must not refuse first."""
    r = post(tiny_server.url, "/generate", {"inputs": "hello " * 2000 + "world",
                                            "parameters": {"truncate": 8, "max_new_tokens": 1, "details": True,
                                                           "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    assert len(r.json()["details"]["prefill"]) == 8


# -- 5. meaningless numbers were accepted ---------------------------------------------------

@pytest.mark.parametrize("parameters", [
    '"temperature": Infinity', '"temperature": 1e999', '"temperature": NaN', '"top_p": NaN',
    '"repetition_penalty": Infinity', '"repetition_penalty": 1e-300', '"repetition_penalty": 1000',
    '"seed": -1', f'"seed": {2**64}', '"max_new_tokens": true', '"top_k": 5.5',
])
def test_tgi_out_of_range_numbers_are_refused(tiny_server, parameters):
    r = raw(tiny_server.url, "/generate", '{"inputs": "hi", "parameters": {"do_sample": true, %s}}' % parameters)
    assert_tgi_error(r, 422)
    assert_serves(tiny_server.url)


@pytest.mark.parametrize("field, value", [
    ("seed", -1), ("seed", 2**64), ("temperature", "Infinity"), ("frequency_penalty", "NaN"),
    ("repetition_penalty", 1e-300), ("stop", ["x"] * 2000), ("stop", "y" * 100_000),
    ("stop_token_ids", [1] * 5000), ("max_tokens", False),
])
def test_openai_out_of_range_fields_are_refused(tiny_server, field, value):
    text = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value}).replace('"Infinity"', "Infinity").replace('"NaN"', "NaN")
    assert_openai_error(raw(tiny_server.url, "/v1/completions", text), 400, field)
    assert_serves(tiny_server.url)


def test_stop_limits_are_the_same_on_both_apis(tiny_server):
    """Seed 004's: up to 1024 sequences of 1 to 1024 characters, 32768 characters in all."""
    assert info(tiny_server.url)["max_stop_sequences"] == MAX_STOP_SEQUENCES
    longest = ["x" * MAX_STOP_LENGTH, *("y" * 30 for _ in range(1023))]           # 32714 characters
    most = ["z" * (MAX_STOP_TOTAL_CHARS // MAX_STOP_SEQUENCES)] * MAX_STOP_SEQUENCES  # 32768 characters
    for ok in (longest, most):
        assert post(tiny_server.url, "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "stop": ok}}).status_code == 200
        assert post(tiny_server.url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stop": ok}).status_code == 200
    r = post(tiny_server.url, "/generate", {"inputs": "hi", "parameters": {"stop": most + ["z"]}})
    assert_tgi_error(r, 422, "stop", str(MAX_STOP_SEQUENCES))
    r = post(tiny_server.url, "/generate", {"inputs": "hi", "parameters": {"stop": most[:-1] + ["z" * 33]}})
    assert_tgi_error(r, 422, "stop", str(MAX_STOP_TOTAL_CHARS))
    r = post(tiny_server.url, "/v1/completions", {"model": "tiny", "prompt": "hi", "stop": most[:-1] + ["z" * 33]})
    assert_openai_error(r, 400, "stop", str(MAX_STOP_TOTAL_CHARS))
    r = post(tiny_server.url, "/generate", {"inputs": "hi", "parameters": {"stop": "w" * (MAX_STOP_LENGTH + 1)}})
    assert_tgi_error(r, 422, "stop", str(MAX_STOP_LENGTH))


def test_largest_seed_with_several_choices_wraps_within_64_bits(tiny_server):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 2**64 - 1}
    first = post(tiny_server.url, "/v1/completions", body)
    assert first.status_code == 200, first.text
    again = post(tiny_server.url, "/v1/completions", body)
    assert [c["text"] for c in first.json()["choices"]] == [c["text"] for c in again.json()["choices"]]


# -- 6. booleans were taken as token ids ----------------------------------------------------

@pytest.mark.parametrize("prompt", [[[False]], [True, 5], [[1, 2.0]]])
def test_prompt_token_ids_must_be_integers(tiny_server, prompt):
    r = post(tiny_server.url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert_openai_error(r, 400, "prompt")
    assert_serves(tiny_server.url)
