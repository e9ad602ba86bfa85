"""The built-in templates' tool formats: tools, an assistant's calls and tool results rendered
the way each family writes them, and read back by that family's tool-call parser."""

from __future__ import annotations

import json

import pytest

from llmserve.chat_template import CHAT_TEMPLATES, ChatTemplateError
from llmserve.tool_parsers import FunctionCall, tool_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "Thanks"},
]


def render(name: str, messages=CONVERSATION, tools=(WEATHER,)) -> str:
    return CHAT_TEMPLATES.get(name)().messages2prompt(messages, tools=list(tools) if tools else None)


def test_chatml_hermes_format():
    text = render("chatml")
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n") in rest
    # both results in one user turn
    assert ("<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
            "<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n") in rest
    # without a system message, the tools join the template's default one
    assert render("qwen", CONVERSATION[1:2]).startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")


def test_llama3_json_format():
    text = render("llama3")
    user = text.split("<|start_header_id|>user<|end_header_id|>\n\n", 2)[1].split("<|start_header_id|>")[0]
    assert user.startswith("You may call") and json.dumps(WEATHER, indent=4) in user and user.endswith(
        "Weather in Paris?<|eot_id|>")
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
            "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n22 C<|eot_id|>") in text


def test_mistral_format():
    text = render("mistral")
    assert text.startswith('[INST] Be brief.\n\nWeather in Paris? [/INST] [TOOL_CALLS] [{"name": "get_weather", '
                           '"arguments": {"city": "Paris"}, "id": "call_1"}]</s>[TOOL_RESULTS] {"content": "22 C", '
                           '"call_id": "call_1"}[/TOOL_RESULTS]')
    # the tools come right before the last instruction
    assert text.endswith(f"[AVAILABLE_TOOLS] [{json.dumps(WEATHER)}][/AVAILABLE_TOOLS][INST] Thanks [/INST]")


@pytest.mark.parametrize("name,parser", [("chatml", "hermes"), ("llama3", "llama3_json"), ("mistral", "mistral")])
def test_a_rendered_call_parses_back(name, parser):
    """The answer the template writes for a call is what the family's parser reads as that call."""
    template = CHAT_TEMPLATES.get(name)()
    with_call = template.messages2prompt(CONVERSATION[:3])
    without = template.messages2prompt(CONVERSATION[:2])
    answer = with_call[len(without):]
    answer = answer[:answer.rindex(template.eoa)] if template.eoa else answer
    calls = tool_parser(parser).parse(answer.strip()).calls
    assert calls == (FunctionCall("get_weather", '{"city": "Paris"}'),)
    assert template.tool_format.parser == parser


def test_without_tools_the_prompt_is_unchanged():
    plain = CONVERSATION[:2]
    for name in ("chatml", "llama3", "mistral"):
        assert render(name, plain, tools=None) == CHAT_TEMPLATES.get(name)().messages2prompt(plain)


@pytest.mark.parametrize("messages,tools", [(CONVERSATION[:2], [WEATHER]), (CONVERSATION[:4], None)])
def test_a_template_without_a_tool_format_refuses_tools(messages, tools):
    with pytest.raises(ChatTemplateError, match="no format for tools"):
        CHAT_TEMPLATES.get("vicuna")().messages2prompt(messages, tools=tools)
