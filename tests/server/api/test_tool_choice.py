"""What tool_choice makes of a request (server/api/tools.py), without a server: the constraint
it sets on decoding, and that every answer the constraint allows parses into calls."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from llmserve.server.api.errors import APIError
from llmserve.server.api.tools import NamedToolChoice, Tool, required_calls_schema, tool_use
from llmserve.tool_parsers import FunctionCall, tool_parser

TOOLS = [Tool.model_validate(t) for t in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},
    # a schema that leaves the object open: any arguments
    {"type": "function", "function": {"name": "remember", "parameters": {"type": "object"}}},
]]
REQUIRED_SCHEMA = required_calls_schema(TOOLS, None)


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_none_and_no_tools_mean_plain_text():
    assert tool_use(TOOLS, "none", None, tool_parser("hermes")) is None
    assert tool_use(None, None, None, None) is None


def test_auto_uses_the_servers_parser_unconstrained():
    use = tool_use(TOOLS, None, None, tool_parser("hermes"))
    assert use.guided_decoding is None and use.parser.name == "hermes" and len(use.tools) == 3
    assert tool_use(TOOLS, "auto", False, tool_parser("hermes")).max_calls == 1
    with pytest.raises(APIError, match="--tool-call-parser"):
        tool_use(TOOLS, "auto", None, None)


def test_named_constrains_to_the_functions_arguments():
    use = tool_use(TOOLS, named("get_weather"), None, None)
    assert json.loads(use.guided_decoding.json) == TOOLS[0].function.parameters
    assert use.parse('{"city": "Paris"}') == (None, [FunctionCall("get_weather", '{"city": "Paris"}')])
    # a function without parameters takes no arguments (OpenAI: "an empty parameter list")
    no_args = json.loads(tool_use(TOOLS, named("get_time"), None, None).guided_decoding.json)
    assert jsonschema.Draft202012Validator(no_args).is_valid({})
    assert not jsonschema.Draft202012Validator(no_args).is_valid({"x": 1})


def _open_tool(**overrides) -> Tool:
    """A tool whose schema, as pydantic and LangChain write them, says nothing of other keys."""
    function = {"name": "lookup", "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                 "required": ["query"]}}
    return Tool.model_validate({"type": "function", "function": function | overrides})


@pytest.mark.parametrize("choice", ["required", "named"])
def test_constrained_arguments_hold_only_the_declared_keys(choice):
    """An undeclared key is closed off (a small model once repeated one until the length limit),
    unless the function says strict: false or its schema speaks of other keys itself."""
    def allows_extra_key(tool: Tool) -> bool:
        use = tool_use([tool], "required" if choice == "required" else named("lookup"), None, None)
        args = {"query": "x", "description": "y"}
        answer = [{"name": "lookup", "arguments": args}] if choice == "required" else args
        return jsonschema.Draft202012Validator(json.loads(use.guided_decoding.json)).is_valid(answer)

    assert not allows_extra_key(_open_tool())
    assert allows_extra_key(_open_tool(strict=False))
    assert allows_extra_key(_open_tool(parameters={"type": "object", "properties": {"query": {"type": "string"}},
                                                   "additionalProperties": {"type": "string"}}))


def test_required_schema():
    use = tool_use(TOOLS, "required", None, None)
    assert json.loads(use.guided_decoding.json) == REQUIRED_SCHEMA
    validator = jsonschema.Draft202012Validator(REQUIRED_SCHEMA)
    assert validator.is_valid([{"name": "get_weather", "arguments": {"city": "Paris"}},
                               {"name": "get_time", "arguments": {}}])
    for wrong in ([], [{"name": "get_news", "arguments": {}}], [{"name": "get_weather", "arguments": {"days": 2}}],
                  [{"name": "get_weather", "arguments": {"city": "Paris"}, "extra": 1}]):
        assert not validator.is_valid(wrong), wrong
    one = json.loads(tool_use(TOOLS, "required", False, None).guided_decoding.json)
    assert one["maxItems"] == 1


WEATHER_CALLS = st.fixed_dictionaries({"name": st.just("get_weather"), "arguments": st.fixed_dictionaries(
    {"city": st.text()}, optional={"days": st.integers(min_value=1)})})
TIME_CALLS = st.fixed_dictionaries({"name": st.just("get_time"), "arguments": st.just({})})
OPEN_CALLS = st.fixed_dictionaries({"name": st.just("remember"), "arguments": st.dictionaries(
    st.text(max_size=5), st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False)
                                      | st.text(), lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
                                      max_leaves=5), max_size=3)})


@settings(max_examples=50, deadline=None)
@given(st.lists(WEATHER_CALLS | TIME_CALLS | OPEN_CALLS, min_size=1, max_size=3))
def test_every_answer_the_required_schema_allows_parses(calls):
    jsonschema.validate(calls, REQUIRED_SCHEMA)
    use = tool_use(TOOLS, "required", None, None)
    for text in (json.dumps(calls), json.dumps(calls, indent=2)):
        content, parsed = use.parse(text)
        assert content is None
        assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(c["name"], c["arguments"]) for c in calls]


def test_answer_message_and_deltas():
    """A call makes finish_reason "tool_calls" (unless the answer was cut short), in a whole
    answer and in a stream, whose deltas carry the calls' indices in order."""
    from llmserve.server.api.openai.render import answer_delta, answer_message

    use = tool_use(TOOLS, "auto", None, tool_parser("hermes"))
    answer = ('Sure.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    message, reason = answer_message(answer, "stop", use)
    assert reason == "tool_calls" and message["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]
    assert message["tool_calls"][0]["id"].startswith("call_") and message["tool_calls"][0]["type"] == "function"
    assert answer_message(answer, "length", use)[1] == "length"
    assert answer_message("Hello", "stop", use) == ({"role": "assistant", "content": "Hello"}, "stop")

    stream = use.stream()
    pieces = [answer[i:i + 5] for i in range(0, len(answer), 5)]
    deltas = [answer_delta(stream, p, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    assert "".join(d.get("content") or "" for d, _ in deltas) == "Sure."
    calls = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_time"), (1, "get_weather")]
    assert deltas[-1][1] == "tool_calls" and all(r is None for _, r in deltas[:-1])


def test_the_servers_parser_for_auto():
    """--tool-call-parser wins; else the built-in template's tool format, or the tags a Jinja template writes."""
    from llmserve.chat_template import CHAT_TEMPLATES, ChosenTemplate, JinjaTemplate
    from llmserve.cli import build_parser
    from llmserve.server.api.state import auto_tool_parser

    def registry(name: str) -> ChosenTemplate:
        return ChosenTemplate(CHAT_TEMPLATES.get(name)(), name, "registry")

    def jinja(source: str) -> ChosenTemplate:
        return ChosenTemplate(JinjaTemplate(source=source), "t.jinja", "jinja")

    assert auto_tool_parser("mistral", registry("chatml")).name == "mistral"
    assert [auto_tool_parser(None, registry(n)).name for n in ("qwen", "llama3", "mistral")] == [
        "hermes", "llama3_json", "mistral"]
    assert auto_tool_parser(None, registry("vicuna")) is None and auto_tool_parser(None, None) is None
    assert auto_tool_parser(None, jinja("{{ '<|python_tag|>' }}")).name == "llama3_json"
    assert auto_tool_parser(None, jinja("{{ messages }}")) is None
    assert build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
