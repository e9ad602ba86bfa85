"""Structured output end to end, through the clients people use: the ``openai`` SDK's
``chat.completions.parse`` with a pydantic model and ``response_format`` json_object,
huggingface_hub's ``text_generation(grammar=...)``, vLLM's ``guided_*`` fields; streaming and
not; schemas the grammar library cannot compile, which are 4xx naming the field; and a property
test: every output sampled at temperature 1 under a generated JSON schema, regex or choice list
parses and validates, on the tiny random model and the embedded one."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from huggingface_hub import InferenceClient
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import BaseModel, Field

# -- strategies --------------------------------------------------------------------------
# Every schema here has a bounded language (strings capped, integers ranged, arrays capped,
# formats of fixed shape), so that a random model sampling at temperature 1 finishes it.

FORMATS = ["date", "uuid", "ipv4"]   # llguidance supports these (and more of unbounded length)
names = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
leaves = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 5000)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(FORMATS)),
    st.lists(st.one_of(names, st.integers(-50, 50), st.booleans()), min_size=1, max_size=5, unique=True)
      .map(lambda values: {"enum": values}),
)


def _object(props: dict, required_all: bool) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required_all else list(props)[:1],
            "additionalProperties": False}


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.builds(_object, st.dictionaries(names, children, min_size=1, max_size=4), st.booleans()),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
        st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
    )


def _with_ref(schema: dict, name: str) -> dict:
    """``schema`` moved under ``$defs`` and used through ``$ref``, twice."""
    return {"$defs": {name: schema}, "type": "object", "additionalProperties": False, "required": ["a", "b"],
            "properties": {"a": {"$ref": f"#/$defs/{name}"}, "b": {"type": "array", "items": {"$ref": f"#/$defs/{name}"},
                                                                      "maxItems": 2}}}


inner = st.recursive(leaves, _extend, max_leaves=8)
schemas = st.one_of(
    st.builds(_object, st.dictionaries(names, inner, min_size=1, max_size=4), st.booleans()),
    st.builds(_with_ref, inner, names),
    inner,
)
# Regexes of bounded pieces: classes and literals with {m,n}, and alternations.
regex_pieces = st.one_of(
    st.builds(lambda cls, m, extra: f"{cls}{{{m},{m + extra}}}", st.sampled_from(["[a-z]", "[0-9]", "[A-F0-9]", r"\d"]),
              st.integers(1, 4), st.integers(0, 3)),
    st.text("abcxyz-:/", min_size=1, max_size=3).map(re.escape),
    st.lists(st.text("abcdef", min_size=1, max_size=4), min_size=2, max_size=3, unique=True)
      .map(lambda words: "(" + "|".join(words) + ")"),
)
regexes = st.lists(regex_pieces, min_size=1, max_size=5).map("".join)
choices = st.lists(st.text("abcdefghij XYZ-", min_size=1, max_size=10), min_size=1, max_size=5, unique=True)

VALIDATOR_FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"], "additionalProperties": False}


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)


@pytest.fixture(scope="module")
def oai(embedded_server):
    return embedded_server.openai_client()


def test_openai_parse_with_a_pydantic_model(oai):
    r = oai.chat.completions.parse(model="tgi", response_format=City, temperature=0, max_tokens=80,
                                   messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop", r.choices[0].message.content


def test_openai_json_schema_streamed(oai):
    stream = oai.chat.completions.create(
        model="tgi", temperature=1.0, seed=3, max_tokens=80, stream=True,
        messages=[{"role": "user", "content": "A person, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_json_object(oai, stream: bool):
    kwargs = dict(model="tgi", temperature=0, max_tokens=60, response_format={"type": "json_object"},
                  messages=[{"role": "user", "content": "Give the capital of France as a JSON object."}])
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kwargs))
    else:
        text = oai.chat.completions.create(**kwargs).choices[0].message.content
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("stream", [False, True])
def test_tgi_grammar_through_huggingface_hub(embedded_server, stream: bool):
    client = InferenceClient(embedded_server.url)
    kwargs = dict(max_new_tokens=80, do_sample=True, seed=1, temperature=1.0)
    out = client.text_generation("A person as JSON:", grammar={"type": "json", "value": PERSON_SCHEMA},
                                 stream=stream, **kwargs)
    text = "".join(out) if stream else out
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    regex = r"[0-9]{3}-[0-9]{4}"
    out = client.text_generation("Call me at", grammar={"type": "regex", "value": regex}, stream=stream, **kwargs)
    assert re.fullmatch(regex, "".join(out) if stream else out)


def test_tgi_grammar_schema_as_a_string(tiny_server):
    r = httpx.post(f"{tiny_server.url}/generate", timeout=60, json={"inputs": "JSON:", "parameters": {
        "max_new_tokens": 80, "grammar": {"type": "json", "value": json.dumps(PERSON_SCHEMA)}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["generated_text"]), PERSON_SCHEMA)


def test_vllm_guided_fields(tiny_server):
    oai = tiny_server.openai_client()
    r = oai.completions.create(model="tgi", prompt="Is the sky blue? Answer:", max_tokens=10, temperature=1.0,
                               n=3, seed=0, extra_body={"guided_choice": ["yes", "no"]})
    assert {c.text for c in r.choices} <= {"yes", "no"}
    r = oai.completions.create(model="tgi", prompt="A date:", max_tokens=20, temperature=1.0, seed=0,
                               extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].text)
    r = oai.completions.create(model="tgi", prompt="A person:", max_tokens=80, temperature=1.0, seed=0,
                               extra_body={"structured_outputs": {"json": PERSON_SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON_SCHEMA)
    r = oai.chat.completions.create(model="tgi", max_tokens=20, temperature=1.0, seed=0,
                                    messages=[{"role": "user", "content": "Pick one"}],
                                    extra_body={"guided_grammar": 'start: "a" | "b" "c"'})
    assert r.choices[0].message.content in ("a", "bc")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json", "missing"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
]


def test_openai_bad_grammars_are_400_naming_the_field(tiny_server):
    for extra, param, words in BAD:
        for route, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/completions", {"prompt": "hi"})]:
            r = httpx.post(tiny_server.url + route, json={"model": "tgi", "max_tokens": 4, **body, **extra}, timeout=60)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error
    # and the server keeps serving
    assert httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200


def test_tgi_bad_grammars_are_422(tiny_server):
    for grammar, words in [
        ({"type": "json", "value": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
        ({"type": "regex", "value": "[0-9"}, "unclosed"),
        ({"type": "yaml", "value": "x"}, "yaml"),
        ("json", "type"),
    ]:
        for route in ["/generate", "/generate_stream", "/"]:
            r = httpx.post(tiny_server.url + route, json={"inputs": "hi", "parameters": {"grammar": grammar}}, timeout=60)
            assert r.status_code == 422, r.text
            assert r.json()["error_type"] == "validation" and words in r.json()["error"] and "grammar" in r.json()["error"]


# -- the property ------------------------------------------------------------------------

def sample(server, body: dict, n: int = 3) -> list[dict]:
    """``n`` completions at temperature 1 of one request (one batch on the server)."""
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tgi", "prompt": "Answer:", "max_tokens": 160, "temperature": 1.0, "n": n, "seed": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"]


@pytest.fixture(params=["tiny_server", "embedded_server"])
def server(request):
    return request.getfixturevalue(request.param)


PROPERTY = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@PROPERTY
@given(schema=schemas)
def test_every_output_validates_against_its_schema(server, schema: dict):
    for choice in sample(server, {"guided_json": schema}):
        assert choice["finish_reason"] == "stop", (schema, choice["text"])
        jsonschema.validate(json.loads(choice["text"]), schema, format_checker=VALIDATOR_FORMATS)


@PROPERTY
@given(regex=regexes, words=choices)
def test_every_output_matches_its_regex_or_choice(server, regex: str, words: list[str]):
    for choice in sample(server, {"guided_regex": regex}):
        assert choice["finish_reason"] == "stop" and re.fullmatch(regex, choice["text"]), (regex, choice["text"])
    for choice in sample(server, {"guided_choice": words}):
        assert choice["text"] in words
