"""A storm of random JSON at every parameter of every generating route, through one real server
(issue 9: "no client input can crash, stall or starve the server").

Each example takes a valid request of one route and puts one to three random JSON values (any
type, any magnitude: ints to ±2**70, 1e999 and NaN as literal text, lone surrogate escapes,
huge and deep lists, ...) at its fields, or drops them, and sends the body as raw bytes. The
server must answer every one with a 2xx or a client error in its API's shape (never a 5xx, nor
a 424 or an error event: those say the engine failed, which client input must never cause), and
stay healthy. Afterwards a greedy request must still give the tokens it gave before the storm,
which are HF transformers' greedy tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from llmserve.server.api.schema import MAX_INPUT_CHARS
from parity_utils import hf_greedy_with_logits
from serving_utils import ServerProcess

TIMEOUT = httpx.Timeout(120.0)
# Short requests keep every generation cheap, whatever max_new_tokens / n / prompt lists say.
SERVER_ARGS = ["--served-model-name", "tiny", "--max-total-tokens", "64", "--max-concurrent-requests", "8"]
EXAMPLES_PER_ROUTE = 35     # x 8 routes, and 10 for /tokenize: 290 in all, about 40 s on 2 cores

# -- random JSON, as text (so that 1e999, NaN and "\ud800" reach the server as written) ----

SPECIAL_INTS = [0, 1, -1, 2, 4, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63 - 1]
SPECIAL_NUMBER_TEXTS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-400", "-0.0", "0.0", "1e308",
                        "5e-324", "0.5", "1.0", "2.0", "1e20", "9223372036854775808.0"]
SPECIAL_STRING_TEXTS = [
    '""', '"\\ud800"', '"ab\\udfffcd"', '"\\udc00\\ud800"', '"\\ud83d\\ude00"', '"\\u0000"', '"tiny"', '"text"',
    '"user"', '"system"', '"assistant"', '"None"', '"5"', '"1e999"', '"NaN"',
    json.dumps("a" * 10_000), json.dumps("hello " * 20_000), json.dumps("x" * (MAX_INPUT_CHARS + 1)),
]
SPECIAL_BULK_TEXTS = [
    "[" + ",".join(['"hi"'] * 2000) + "]",                  # many prompts / stop strings
    "[" + ",".join(["[1,2]"] * 3000) + "]",                  # many token-id prompts
    "[" + ",".join(["1"] * 5000) + "]",
    "[" * 900 + "]" * 900, "[" * 5000 + "]" * 5000,          # deep, and deeper than the parser goes
    '{"a":' * 900 + "1" + "}" * 900,
    '[{"type": "text"}]', '[{"type": "text", "text": "hi"}]', '[{"type": "image_url", "image_url": {"url": "x"}}]',
    '[{"role": "user", "content": "hi"}]', '[{"role": "user"}]', '[{"content": "hi"}]', "[[false]]", "[[]]", "[]", "{}",
]

ints = st.one_of(st.integers(-2**70, 2**70), st.sampled_from(SPECIAL_INTS)).map(str)
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False).map(repr), st.sampled_from(SPECIAL_NUMBER_TEXTS))
strings = st.one_of(st.text(max_size=30).map(json.dumps), st.sampled_from(SPECIAL_STRING_TEXTS))
scalars = st.one_of(ints, floats, strings, st.sampled_from(["null", "true", "false"]))
keys = st.one_of(st.sampled_from(["type", "text", "role", "content", "include_usage", "url", "a"]), st.text(max_size=5))


def _array(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


def _object(items: dict[str, str]) -> str:
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in items.items()) + "}"


json_texts = st.one_of(
    st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4).map(_array),
                                                   st.dictionaries(keys, inner, max_size=4).map(_object)),
                 max_leaves=8),
    st.sampled_from(SPECIAL_BULK_TEXTS),
)


class JSONText(str):
    """A JSON text to put at a field; shown cut short where Hypothesis reports a failing case."""

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self[:80] + "...") + f" ({len(self)} chars)" if len(self) > 80 else repr(str(self)))


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()   # drop the field

# Values of the type a field takes reach the range checks and the engine, where the bugs of
# issue 9 were; values of any other type test the parser and the type checks.
bools = st.sampled_from(["true", "false"])
numbers = st.one_of(floats, ints)                 # a float field takes ints too
string_lists = st.lists(strings, max_size=5).map(_array)
int_lists = st.lists(ints, max_size=5).map(_array)
content_parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(['"text"', '"image_url"', "5"])},
                                               optional={"text": strings}).map(_object), max_size=3).map(_array)
FIELD_TYPES: dict[str | int, st.SearchStrategy[str]] = {
    **dict.fromkeys(["best_of", "max_new_tokens", "seed", "top_k", "top_n_tokens", "truncate", "n", "min_tokens",
                     "max_tokens", "max_completion_tokens", "top_logprobs"], ints),
    **dict.fromkeys(["frequency_penalty", "presence_penalty", "repetition_penalty", "temperature", "top_p",
                     "typical_p"], numbers),
    **dict.fromkeys(["decoder_input_details", "details", "do_sample", "return_full_text", "watermark", "stream",
                     "ignore_eos", "echo", "include_usage"], bools),
    **dict.fromkeys(["adapter_id", "inputs", "model", "user", "suffix", "role", "name"], strings),
    "logprobs": st.one_of(ints, bools),           # an int on /v1/completions, a bool on chat
    "stop": st.one_of(strings, string_lists),
    "stop_token_ids": int_lists,
    "prompt": st.one_of(strings, string_lists, int_lists, st.lists(int_lists, max_size=3).map(_array)),
    0: st.one_of(strings, int_lists),             # prompt.0
    "content": st.one_of(strings, content_parts),
}


# -- the routes, a valid request of each, and where values go ------------------------------

TGI_PARAMETERS = ["adapter_id", "best_of", "decoder_input_details", "details", "do_sample", "frequency_penalty",
                  "grammar", "max_new_tokens", "repetition_penalty", "return_full_text", "seed", "stop", "temperature",
                  "top_k", "top_n_tokens", "top_p", "truncate", "typical_p", "watermark"]
OPENAI_SAMPLING = ["model", "n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop",
                   "stream", "stream_options", "user", "logit_bias", "top_k", "repetition_penalty", "ignore_eos",
                   "min_tokens", "stop_token_ids", "max_tokens"]
Path = tuple[str | int, ...]

TGI_BASE = {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "details": True}}
TGI_FIELDS: list[Path] = [(), ("inputs",), ("parameters",), ("stream",)] + [("parameters", p) for p in TGI_PARAMETERS]
COMPLETION_BASE = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
COMPLETION_FIELDS: list[Path] = [(), ("prompt",), ("prompt", 0), ("logprobs",), ("echo",), ("best_of",), ("suffix",),
                                  ("stream_options", "include_usage")] + [(f,) for f in OPENAI_SAMPLING]
CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CHAT_FIELDS: list[Path] = [(), ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
                           ("messages", 0, "name"), ("max_completion_tokens",), ("logprobs",), ("top_logprobs",),
                           ("tools",), ("tool_choice",), ("parallel_tool_calls",), ("messages", 0, "tool_calls"),
                           ("messages", 0, "tool_call_id"), ("response_format",), ("stream_options", "include_usage")] + \
    [(f,) for f in OPENAI_SAMPLING]

ROUTES: dict[str, tuple[str, dict[str, Any], list[Path]]] = {
    "generate": ("/generate", TGI_BASE, TGI_FIELDS),
    "generate_stream": ("/generate_stream", TGI_BASE, TGI_FIELDS),
    "compat": ("/", TGI_BASE, TGI_FIELDS),
    "compat_stream": ("/", TGI_BASE | {"stream": True}, TGI_FIELDS),
    "tokenize": ("/tokenize", {"inputs": "Hello"}, [(), ("inputs",), ("parameters",), ("parameters", "truncate")]),
    "completions": ("/v1/completions", COMPLETION_BASE, COMPLETION_FIELDS),
    "completions_stream": ("/v1/completions", COMPLETION_BASE | {"stream": True}, COMPLETION_FIELDS),
    "chat": ("/v1/chat/completions", CHAT_BASE, CHAT_FIELDS),
    "chat_stream": ("/v1/chat/completions", CHAT_BASE | {"stream": True}, CHAT_FIELDS),
}


def raw_body(base: dict[str, Any], changes: list[tuple[Path, Any]]) -> bytes:
    """``base`` as JSON with each change applied in order: a JSON text put at its path (objects
    made where missing), or ABSENT to drop the field. A change under a field that an earlier
    change made a non-object is skipped."""
    body: Any = json.loads(json.dumps(base))
    raws: list[str] = []

    def marked(text: str) -> str:      # a placeholder, replaced by the raw text once dumped
        raws.append(text)
        return f"\x00raw{len(raws) - 1}\x00"

    for path, value in changes:
        if not path:
            body = {} if value is ABSENT else marked(value)
            continue
        parent = body
        for key in path[:-1]:
            parent = _child(parent, key)
        key = path[-1]
        if isinstance(parent, list) and isinstance(key, int) and key < len(parent):
            if value is not ABSENT:
                parent[key] = marked(value)
        elif isinstance(parent, dict):
            if value is ABSENT:
                parent.pop(key, None)
            else:
                parent[key] = marked(value)
    text = json.dumps(body)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw, 1)
    return text.encode()


def _child(parent: Any, key: str | int) -> Any:
    if isinstance(parent, dict):
        return parent.setdefault(key, {})
    if isinstance(parent, list) and isinstance(key, int) and key < len(parent):
        return parent[key]
    return None


def changes_for(fields: list[Path]) -> st.SearchStrategy[list[tuple[Path, Any]]]:
    """One to three changes; of five, three put a value of the field's own type, one any JSON
    and one drops the field."""

    def change(path: Path) -> st.SearchStrategy[tuple[Path, Any]]:
        typed = FIELD_TYPES.get(path[-1]) if path else None
        options = [typed] * 3 + [json_texts] if typed is not None else [json_texts] * 4
        value = st.sampled_from([o.map(JSONText) for o in options] + [st.just(ABSENT)]).flatmap(lambda v: v)
        return st.tuples(st.just(path), value)

    return st.lists(st.sampled_from(fields).flatmap(change), min_size=1, max_size=3)


# -- what every answer must be -------------------------------------------------------------

# 424 and 5xx say the engine or the server failed; 429 cannot happen to requests sent one at a time.
CLIENT_ERRORS = {400, 404, 413, 415, 422}


def assert_error_shape(path: str, payload: Any) -> None:
    if path.startswith("/v1/"):
        assert isinstance(payload, dict) and set(payload) == {"error"}, payload
        assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
        assert isinstance(payload["error"]["message"], str)
    else:
        assert isinstance(payload, dict) and set(payload) == {"error", "error_type"}, payload
        assert isinstance(payload["error"], str) and isinstance(payload["error_type"], str)


def sse_events(text: str) -> list[Any]:
    events = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[len("data:"):].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def check_answer(path: str, status: int, content_type: str, text: str) -> None:
    assert status == 200 or status in CLIENT_ERRORS, f"{status}: {text[:500]}"
    if status != 200:
        assert content_type.startswith("application/json"), content_type
        assert_error_shape(path, json.loads(text))
    elif content_type.startswith("text/event-stream"):
        events = sse_events(text)
        assert events, text[:500]
        for event in events:
            # an error event is the engine failing a request it had accepted
            assert not (isinstance(event, dict) and "error" in event), event
        # a stream ends as its API ends one, not cut short
        if path.startswith("/v1/"):
            assert events[-1] == "[DONE]", events[-3:]
        else:
            assert events[-1]["generated_text"] is not None, events[-1]
    else:
        payload = json.loads(text)
        if path.startswith("/v1/"):
            assert payload["choices"], payload
        elif path == "/":
            assert isinstance(payload, list) and "generated_text" in payload[0], payload
        elif path == "/generate":
            assert isinstance(payload["generated_text"], str), payload
        else:
            assert isinstance(payload, list), payload


# -- the server, and what a greedy request gives before and after the storm ----------------

GREEDY = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 4, "details": True,
                                                           "decoder_input_details": True}}
GREEDY_OPENAI = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}


def greedy_answers(client: httpx.Client) -> tuple[list[int], list[int], str]:
    """The greedy TGI request's prompt ids and generated ids, and the greedy OpenAI text."""
    r = client.post("/generate", json=GREEDY)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    r2 = client.post("/v1/completions", json=GREEDY_OPENAI)
    assert r2.status_code == 200, r2.text
    return [t["id"] for t in details["prefill"]], [t["id"] for t in details["tokens"]], r2.json()["choices"][0]["text"]


@dataclass
class Storm:
    server: ServerProcess
    client: httpx.Client
    before: tuple[list[int], list[int], str]     # greedy_answers() before the storm
    killed_by: str | None = None                  # the request after which the server was down


@pytest.fixture(scope="module")
def storm(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, *SERVER_ARGS) as server, \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        yield Storm(server, client, greedy_answers(client))


def send(client: httpx.Client, path: str, body: bytes) -> tuple[int, str, str]:
    with client.stream("POST", path, content=body, headers={"content-type": "application/json"}) as r:
        text = r.read().decode("utf-8", errors="replace")
        return r.status_code, r.headers.get("content-type", ""), text


def is_healthy(client: httpx.Client) -> bool:
    try:
        return client.get("/health").status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("route", list(ROUTES))
def test_random_json_at_each_field_gets_a_client_error_or_an_answer(storm, route):
    path, base, fields = ROUTES[route]

    @settings(max_examples=10 if route == "tokenize" else EXAMPLES_PER_ROUTE, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(changes=changes_for(fields))
    def storm_route(changes: list[tuple[Path, Any]]) -> None:
        if storm.killed_by is not None:
            # pytest.fail is no Exception: Hypothesis lets it through instead of "shrinking"
            # to whatever request happened to meet the dead server
            pytest.fail(f"the server went down after {storm.killed_by}", pytrace=False)
        body = raw_body(base, changes)
        request = f"POST {path} {body[:300]!r}{' ...' if len(body) > 300 else ''}"
        note(request)
        try:
            answer = send(storm.client, path, body)
        except httpx.TransportError as e:
            answer = None
            note(f"no answer: {e!r}")
        if not is_healthy(storm.client):
            storm.killed_by = request
            pytest.fail(f"the server went down after {request}", pytrace=False)
        assert answer is not None, "the connection failed, though the server is up"
        check_answer(path, *answer)

    storm_route()


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_after_the_storm_greedy_still_gives_hfs_tokens(storm, tiny_llama_dir):
    """Run last in this file (pytest keeps file order): nothing the storm sent may have changed
    the server's state: the same greedy tokens as before it, which are HF's, and nothing left
    in flight or holding KV slots."""
    from transformers import AutoModelForCausalLM

    server, client, (prompt_ids, before_ids, before_text) = storm.server, storm.client, storm.before
    assert wait_until(lambda: server.metrics()["llmserve_requests_in_flight"] == 0)
    assert wait_until(lambda: server.metrics()["llmserve_kv_cache_slots_used"] == 0)
    assert greedy_answers(client) == (prompt_ids, before_ids, before_text)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    hf_ids, _ = hf_greedy_with_logits(hf, prompt_ids, len(before_ids))
    assert before_ids == hf_ids
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
