"""The HTTP edge, through real servers (issue 9, items 4, 6 and 7): every error a request can
meet before a route handles it (no such route, wrong method, a body that is not JSON or too
large, no API key) is answered in its API's shape, never FastAPI's ``{"detail": ...}``; the
key is checked before the body is read; /openapi.json documents the statuses the routes give.
Each refusal is followed by a good request that succeeds on the same server.
"""

from __future__ import annotations

import http.client
import json
import socket

import httpx
import pytest

from llmserve.server.api.middleware import DEFAULT_PAYLOAD_LIMIT
from llmserve.server.api.schema import MAX_INPUT_CHARS
from serving_utils import API_KEY, PAYLOAD_LIMIT

TIMEOUT = httpx.Timeout(120.0)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD_TGI = {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "details": True}}
GOOD_OPENAI = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}


# keyed_server: the session's tiny server behind --api-key API_KEY and --payload-limit
# PAYLOAD_LIMIT (conftest)


def assert_serves(url: str, headers: dict[str, str] | None = None) -> None:
    """A good TGI request and a good OpenAI request both succeed."""
    r = httpx.post(url + "/generate", json=GOOD_TGI, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 2, r.text
    r = httpx.post(url + "/v1/completions", json=GOOD_OPENAI, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def assert_shape(r: httpx.Response, path: str, status: int, *words: str) -> str:
    """``r`` is ``status`` in the shape of ``path``'s API; returns its message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    if path.startswith("/v1/"):
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["code"] == status
        message = body["error"]["message"]
    else:
        assert set(body) == {"error", "error_type"}, body
        message = body["error"]
    assert isinstance(message, str) and "\n" not in message
    for word in words:
        assert word.lower() in message.lower(), (word, message)
    return message


# -- item 6: errors before any route, in the API's shape ----------------------------------

@pytest.mark.parametrize("path", ["/no-such-route", "/v1/no-such-route", "/v1/completions/extra"])
def test_unknown_route_is_a_404_in_the_api_shape(tiny_server, path):
    r = httpx.post(tiny_server.url + path, json=GOOD_OPENAI, timeout=TIMEOUT)
    assert_shape(r, path, 404, path)
    assert_serves(tiny_server.url)


@pytest.mark.parametrize("method, path, allowed", [
    ("GET", "/generate", "POST"), ("PUT", "/tokenize", "POST"), ("GET", "/v1/completions", "POST"),
    ("DELETE", "/v1/chat/completions", "POST"), ("POST", "/v1/models", "GET"), ("POST", "/health", "GET"),
])
def test_wrong_method_is_a_405_that_keeps_its_allow_header(tiny_server, method, path, allowed):
    r = httpx.request(method, tiny_server.url + path, timeout=TIMEOUT)
    assert_shape(r, path, 405, method, allowed)
    assert r.headers["allow"] == allowed
    assert_serves(tiny_server.url)


BODY_PARSE_CASES = {
    # name: (content-type, body, TGI status, words)
    "form_encoded": ("application/x-www-form-urlencoded", json.dumps(GOOD_TGI).encode(), 415,
                     ["Content-Type: application/json", "x-www-form-urlencoded"]),
    "text_plain": ("text/plain", json.dumps(GOOD_TGI).encode(), 415, ["Content-Type: application/json", "text/plain"]),
    "no_content_type": (None, json.dumps(GOOD_TGI).encode(), 415, ["Content-Type: application/json"]),
    "invalid_utf8": ("application/json", b'{"inputs": "\xff\xfe"}', 422, ["could not be parsed", "utf-8"]),
    "nested_too_deep": ("application/json", b"[" * 100_000 + b"]" * 100_000, 422, ["could not be parsed"]),
    "no_body": ("application/json", b"", 422, ["no body"]),
    "not_an_object": ("application/json", b"[1, 2]", 422, ["dictionary"]),
    "truncated_json": ("application/json", b'{"inputs": "hi"', 422, ["not valid JSON"]),
}


@pytest.mark.parametrize("case", list(BODY_PARSE_CASES))
@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_a_body_that_does_not_parse_is_refused_in_the_api_shape(tiny_server, path, case):
    content_type, body, status, words = BODY_PARSE_CASES[case]
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(tiny_server.url + path, content=body, headers=headers, timeout=TIMEOUT)
    # OpenAI says 400 where TGI says 422 for a bad request
    assert_shape(r, path, 400 if status == 422 and path.startswith("/v1/") else status, *words)
    assert_serves(tiny_server.url)


def test_no_error_anywhere_is_in_fastapis_detail_shape(tiny_server):
    """What every case above shares, over all routes at once: never ``{"detail": ...}``."""
    paths = ["/generate", "/generate_stream", "/", "/tokenize", "/v1/completions", "/v1/chat/completions"]
    for path in paths:
        for method, body in [("GET", None), ("POST", b"{"), ("POST", b"")]:
            if (method, path) == ("GET", "/"):
                continue      # the chat page (test_chat_page.py), not an error
            r = httpx.request(method, tiny_server.url + path, content=body,
                              headers={"content-type": "application/json"}, timeout=TIMEOUT)
            assert 400 <= r.status_code < 500 and "detail" not in r.json(), (method, path, r.text)
    assert_serves(tiny_server.url)


# -- item 4: the body-size limit, before parsing ------------------------------------------

def send_headers_only(port: int, path: str, headers: dict[str, str]) -> tuple[int, dict]:
    """POST with these headers and no body at all: the answer cannot have waited for the body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", path)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def padded(body: dict, size: int) -> bytes:
    """``body`` as JSON of exactly ``size`` bytes (trailing whitespace is valid JSON)."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


@pytest.mark.parametrize("path, good", [("/generate", GOOD_TGI), ("/v1/completions", GOOD_OPENAI)])
def test_body_over_the_limit_is_a_413_and_at_the_limit_is_served(keyed_server, path, good):
    url = keyed_server.url + path
    headers = AUTH | {"content-type": "application/json"}
    r = httpx.post(url, content=padded(good, PAYLOAD_LIMIT + 1), headers=headers, timeout=TIMEOUT)
    assert_shape(r, path, 413, str(PAYLOAD_LIMIT), str(PAYLOAD_LIMIT + 1), "--payload-limit")
    r = httpx.post(url, content=padded(good, PAYLOAD_LIMIT), headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert_serves(keyed_server.url, AUTH)


@pytest.mark.parametrize("path", ["/generate_stream", "/v1/chat/completions"])
def test_a_declared_length_over_the_limit_is_refused_before_any_body_is_sent(keyed_server, path):
    status, body = send_headers_only(keyed_server.port, path, AUTH | {
        "Content-Type": "application/json", "Content-Length": str(10**12)})
    assert status == 413
    message = body["error"]["message"] if path.startswith("/v1/") else body["error"]
    assert str(10**12) in message
    assert_serves(keyed_server.url, AUTH)


def send_chunks_without_end(port: int, path: str, size: int) -> bytes:
    """POST ``size`` bytes of a chunked body that never ends (no last chunk), then read until the
    server closes the connection (a server that kept it open would time this out: an error)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        sock.sendall(head.encode())
        chunk = b'{"inputs": "' + b"a" * 500
        for _ in range(size // len(chunk) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        received = b""
        while data := sock.recv(65536):        # b"": the server closed the connection
            received += data
        return received


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_a_chunked_body_is_counted_as_it_arrives(keyed_server, path):
    """No Content-Length to go by: the 413 comes once the chunks pass the limit, before the body
    ends, and the server hangs up rather than read on."""
    received = send_chunks_without_end(keyed_server.port, path, PAYLOAD_LIMIT + 1000)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), received
    assert b"connection: close" in head.lower()
    payload = json.loads(body)
    message = payload["error"]["message"] if path.startswith("/v1/") else payload["error"]
    assert f"more than {PAYLOAD_LIMIT} bytes" in message

    def chunked_good_body():      # a chunked body within the limit is served
        yield b'{"model": "tiny", "max_tokens": 2, '
        yield b'"messages": [{"role": "user", "content": "hi"}], "inputs": "Hello"}'
    r = httpx.post(keyed_server.url + path, content=chunked_good_body(), timeout=TIMEOUT,
                   headers=AUTH | {"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert_serves(keyed_server.url, AUTH)


def test_the_default_limit_admits_the_seeds_4mb_of_characters_however_escaped(tiny_server):
    """Seed 004: up to 4 MiB characters of input. `requests` (and so the text_generation client)
    escapes each non-ASCII character as 6 bytes of JSON; such a body must reach the input checks
    (a 422 for too many tokens on this 512-token model), and one byte past the limit must not."""
    body = json.dumps({"inputs": "é" * MAX_INPUT_CHARS, "parameters": {"max_new_tokens": 1}}).encode()
    assert len(body) <= DEFAULT_PAYLOAD_LIMIT
    r = httpx.post(tiny_server.url + "/generate", content=body, headers={"content-type": "application/json"},
                   timeout=TIMEOUT)
    assert_shape(r, "/generate", 422, "inputs", "tokens")
    status, _ = send_headers_only(tiny_server.port, "/generate", {
        "Content-Type": "application/json", "Content-Length": str(DEFAULT_PAYLOAD_LIMIT + 1)})
    assert status == 413
    assert_serves(tiny_server.url)


# -- item 7: the API key first, the docs behind it -----------------------------------------

@pytest.mark.parametrize("path, content", [
    ("/generate", b'{"inputs": 5'),                            # malformed: was a 422 before the 401
    ("/v1/completions", b'{"model": "tiny", "prompt": [[false]]}'),  # invalid: was a 400
    ("/v1/chat/completions", b"x" * (PAYLOAD_LIMIT * 4)),      # too large: the key comes first
    ("/no-such-route", b"{}"),                                  # no route: no hint of which exist
])
def test_without_the_key_a_request_is_refused_before_its_body_is_looked_at(keyed_server, path, content):
    r = httpx.post(keyed_server.url + path, content=content, headers={"content-type": "application/json"},
                   timeout=TIMEOUT)
    assert_shape(r, path, 401, "Unauthorized")
    assert_serves(keyed_server.url, AUTH)


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_docs_need_the_key(keyed_server, path):
    assert_shape(httpx.get(keyed_server.url + path, timeout=TIMEOUT), path, 401, "Unauthorized")
    assert_shape(httpx.get(keyed_server.url + path, headers={"Authorization": "Bearer wrong"}, timeout=TIMEOUT),
                 path, 401)
    assert httpx.get(keyed_server.url + path, headers=AUTH, timeout=TIMEOUT).status_code == 200
    assert httpx.get(keyed_server.url + "/health", timeout=TIMEOUT).status_code == 200   # /health: never


def test_with_the_key_errors_are_the_routes_own(keyed_server):
    r = httpx.post(keyed_server.url + "/generate", content=b'{"inputs": 5', timeout=TIMEOUT,
                   headers=AUTH | {"content-type": "application/json"})
    assert_shape(r, "/generate", 422, "not valid JSON")
    assert_shape(httpx.get(keyed_server.url + "/v1/nope", headers=AUTH, timeout=TIMEOUT), "/v1/nope", 404)
    assert_serves(keyed_server.url, AUTH)


# -- item 6: /openapi.json lists the real statuses -----------------------------------------

TGI_GENERATION = {"413", "415", "422", "424", "429"}
OPENAI_GENERATION = {"400", "404", "413", "415", "422", "424", "429"}
EXPECTED_ERRORS = {
    ("post", "/generate"): TGI_GENERATION, ("post", "/generate_stream"): TGI_GENERATION,
    ("post", "/"): TGI_GENERATION, ("post", "/tokenize"): {"400", "404", "413", "415", "422"},
    ("post", "/v1/completions"): OPENAI_GENERATION, ("post", "/v1/chat/completions"): OPENAI_GENERATION,
    ("post", "/v1/chat/interactive"): OPENAI_GENERATION | {"409", "501"},   # 501: --api-server-count > 1
    ("get", "/v1/models"): set(), ("get", "/info"): set(), ("get", "/metrics"): set(), ("get", "/health"): {"503"},
    ("post", "/detokenize"): {"400", "404", "413", "415"}, ("get", "/tokenizer_info"): set(),
    ("get", "/v1/models/{model_id}"): {"404"}, ("get", "/version"): set(),
}
# /tokenize answers vLLM's bodies in OpenAI's shape (its 400 and 404), TGI's in TGI's; vLLM's
# other routes are OpenAI's.
OPENAI_SHAPED = {("/tokenize", "400"), ("/tokenize", "404"), ("/detokenize", "*"), ("/tokenizer_info", "*")}


def openai_shaped(path: str, status: str) -> bool:
    return path.startswith("/v1/") or (path, status) in OPENAI_SHAPED or (path, "*") in OPENAI_SHAPED


def documented_errors(schema: dict) -> dict[tuple[str, str], dict[str, dict]]:
    return {(method, path): {s: r for s, r in op["responses"].items() if s != "200"}
            for path, ops in schema["paths"].items() for method, op in ops.items()}


def resolve(schema: dict, ref: str) -> dict:
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


def required_keys(schema: dict, response: dict) -> set[str]:
    return set(resolve(schema, response["content"]["application/json"]["schema"]["$ref"])["required"])


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "api-key"])
def test_openapi_documents_each_routes_errors_in_its_shape(tiny_server, keyed_server, keyed):
    server, headers = (keyed_server, AUTH) if keyed else (tiny_server, {})
    schema = httpx.get(server.url + "/openapi.json", headers=headers, timeout=TIMEOUT).json()
    errors = documented_errors(schema)
    assert set(EXPECTED_ERRORS) <= set(errors)
    for (method, path), expected in EXPECTED_ERRORS.items():
        want = expected | ({"401"} if keyed and path != "/health" else set())
        assert set(errors[(method, path)]) == want, (method, path)
        for status, response in errors[(method, path)].items():
            assert response["description"]
            assert required_keys(schema, response) == ({"error"} if openai_shaped(path, status) else {"error", "error_type"})
    assert "HTTPValidationError" not in schema["components"]["schemas"]    # FastAPI's shape: never sent
    assert ("securitySchemes" in schema["components"]) == keyed


def test_the_documented_error_bodies_are_what_the_server_sends(tiny_server):
    """The OpenAI error schema's required fields are exactly those of a real error body."""
    schema = httpx.get(tiny_server.url + "/openapi.json", timeout=TIMEOUT).json()
    detail = schema["components"]["schemas"]["OpenAIErrorDetail"]
    r = httpx.post(tiny_server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "n": 0}, timeout=TIMEOUT)
    assert set(r.json()["error"]) == set(detail["required"]) == set(detail["properties"])
    tgi = schema["components"]["schemas"]["TGIErrorBody"]
    r = httpx.post(tiny_server.url + "/generate", json={"inputs": ""}, timeout=TIMEOUT)
    assert set(r.json()) == set(tgi["required"]) == set(tgi["properties"])
