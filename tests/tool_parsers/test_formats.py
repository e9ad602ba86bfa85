"""Tool-call parsers on literal answers, whole and fed piece by piece (as a stream)."""

from __future__ import annotations

import json

import pytest

from llmserve.tool_parsers import (
    FunctionCall, NamedParser, ParsedAnswer, RequiredParser, ToolCallStream, ToolParser, parser_for_template_source,
    tool_parser, tool_parser_names,
)

WEATHER = FunctionCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
TIME = FunctionCall("get_time", json.dumps({"tz": "Europe/Paris"}))

# (parser, answer, content, calls)
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               '</tool_call>', "Let me check.", [WEATHER]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>', None, [WEATHER, TIME]),
    # the EOS ended the answer before the closing tag: the call is complete all the same
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}', None, [TIME]),
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("hermes", '<tool_call>{"name": "get_time", "argu', '<tool_call>{"name": "get_time", "argu', []),   # cut short
    ("hermes", '<tool_call>{"nom": 1}</tool_call>', '<tool_call>{"nom": 1}</tool_call>', []),         # not a call
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}', None, [WEATHER, TIME]),
    ("llama3_json", 'Sure. <|python_tag|>{"name": "get_time", "arguments": "{\\"tz\\": \\"Europe/Paris\\"}"}', "Sure.", [TIME]),
    ("llama3_json", '{"city": "Paris"} is JSON', '{"city": "Paris"} is JSON', []),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', None, [WEATHER, TIME]),
    ("mistral", 'Checking [TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', "Checking", [TIME]),
    ("mistral", "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
    ("mistral", "Plain [text] answer", "Plain [text] answer", []),
    # the marker is a special token, which decoding may have left out
    ("mistral", ' [{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', None, [TIME]),
    ("mistral", "[1] is a footnote", "[1] is a footnote", []),
    ("mistral", '[{"a": 1}] is JSON', '[{"a": 1}] is JSON', []),
]


def parser_of(name: str) -> ToolParser:
    return {"required": RequiredParser(), "named": NamedParser("get_time")}.get(name) or tool_parser(name)


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[FunctionCall]]:
    s = ToolCallStream(parser)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        new_content, new_calls = s.feed(piece, final=i == len(pieces) - 1)
        content += new_content
        calls += new_calls
    return content, calls


CASES += [
    ("required", '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                 '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', None, [WEATHER, TIME]),
    ("required", '[{"name": "get_weather", "arguments": {"city": "Par', '[{"name": "get_weather", "arguments": {"city": "Par',
     []),
    ("named", ' {"tz": "Europe/Paris"}', None, [TIME]),
    ("named", '{"tz": "Eur', '{"tz": "Eur', []),
]


@pytest.mark.parametrize("name,answer,content,calls", CASES)
def test_parse(name, answer, content, calls):
    assert parser_of(name).parse(answer) == ParsedAnswer(content, tuple(calls))


@pytest.mark.parametrize("piece_len", [1, 3, 7])
@pytest.mark.parametrize("name,answer,content,calls", CASES)
def test_stream_agrees_with_parse(name, answer, content, calls, piece_len):
    pieces = [answer[i:i + piece_len] for i in range(0, len(answer), piece_len)]
    assert stream(parser_of(name), pieces) == (content or "", calls)


def test_stream_holds_back_a_possible_call_start_and_sends_calls_when_complete():
    s = ToolCallStream(tool_parser("hermes"))
    assert s.feed("Let me look.\n<tool") == ("Let me look.", [])
    assert s.feed('_call>{"name": "get_time", "arguments": {"tz": ') == ("", [])
    assert s.feed('"Europe/Paris"}}') == ("", [TIME])
    assert s.feed("\n</tool_call>", final=True) == ("", [])


def test_stream_releases_held_back_text_that_is_no_call():
    s = ToolCallStream(tool_parser("hermes"))
    assert s.feed("a <") == ("a", [])
    assert s.feed("b> c") == (" <b> c", [])


def test_stream_keeps_only_max_calls():
    answer = CASES[1][1]
    assert stream_max(answer, 1) == [WEATHER]


def stream_max(answer: str, max_calls: int) -> list[FunctionCall]:
    return ToolCallStream(tool_parser("hermes"), max_calls=max_calls).feed(answer, final=True)[1]


def test_parser_names_and_template_sniffing():
    assert tool_parser_names() == ["hermes", "llama3_json", "mistral"]
    assert parser_for_template_source("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template_source("{{ '[TOOL_CALLS] ' }}") == "mistral"
    assert parser_for_template_source("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template_source("{{ messages }}") is None


@pytest.mark.parametrize("name,answer,content,calls", CASES)
def test_stream_token_by_token(name, answer, content, calls, smollm2_tokenizer):
    """Fed as a model's tokens come out of the detokenizer (the text each token adds)."""
    ids = smollm2_tokenizer(answer, add_special_tokens=False).input_ids
    texts = [smollm2_tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    pieces = [b[len(a):] for a, b in zip(texts, texts[1:])]
    assert "".join(pieces) == answer
    assert stream(parser_of(name), pieces) == (content or "", calls)
