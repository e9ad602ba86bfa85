"""Tool calling on /v1/chat/completions end to end: a tiny random Llama served with a Hermes-style
Jinja template that renders tools, driven by the `openai` SDK, LangChain and huggingface_hub.

A random model never calls a tool on its own, so what ``auto`` makes of a call is the parser
tests' business (tests/tool_parsers); here: the request fields, their errors, the tools and the
tool history reaching the prompt, and ``none``."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from serving_utils import ServerProcess

JINJA = os.path.join(os.path.dirname(__file__), "..", "..", "chat_template", "hermes_tools.jinja")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ROUND_TRIP = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"}]


@pytest.fixture(scope="module")
def tools_server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--chat-template", JINJA) as server:
        yield server


@pytest.fixture(scope="module")
def oai(tools_server) -> openai.OpenAI:
    return tools_server.openai_client()


def chat(oai: openai.OpenAI, messages, **kwargs):
    return oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, **kwargs)


def rendered_tokens(smollm2_tokenizer, messages, tools=None) -> int:
    """What the server's prompt must be: the template rendered here, calls' arguments as objects."""
    for m in messages:
        for c in m.get("tool_calls") or []:
            c["function"] = c["function"] | {"arguments": json.loads(c["function"]["arguments"])}
    with open(JINJA) as f:
        text = smollm2_tokenizer.apply_chat_template([dict(m, content=m["content"] or "") for m in messages], tools=tools,
                                                     chat_template=f.read(), tokenize=False, add_generation_prompt=True)
    return len(smollm2_tokenizer(text, add_special_tokens=False).input_ids)


def test_auto_puts_the_tools_in_the_prompt_and_answers_text(oai, smollm2_tokenizer):
    r = chat(oai, QUESTION, tools=[WEATHER_TOOL, TIME_TOOL])
    assert r.usage.prompt_tokens == rendered_tokens(smollm2_tokenizer, QUESTION, [WEATHER_TOOL, TIME_TOOL])
    assert r.usage.prompt_tokens > chat(oai, QUESTION).usage.prompt_tokens
    message = r.choices[0].message
    assert message.tool_calls is None and r.choices[0].finish_reason == "length"
    chunks = list(chat(oai, QUESTION, tools=[WEATHER_TOOL, TIME_TOOL], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_tool_choice_none_leaves_the_tools_out(oai):
    r = chat(oai, QUESTION, tools=[WEATHER_TOOL], tool_choice="none")
    plain = chat(oai, QUESTION)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == plain.choices[0].message.content


def test_round_trip_of_a_call_and_its_result(oai, smollm2_tokenizer):
    """The assistant's call and the tool's result reach the prompt; the model answers in text."""
    r = chat(oai, ROUND_TRIP, tools=[WEATHER_TOOL])
    assert r.usage.prompt_tokens == rendered_tokens(smollm2_tokenizer, json.loads(json.dumps(ROUND_TRIP)), [WEATHER_TOOL])
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)


BAD_REQUESTS = [
    ({"tool_choice": "required"}, "tool_choice", "only allowed when `tools`"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not among the tools"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "two tools are named 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools", "not a valid JSON schema"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", None),
    ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [CALL | {"function": {"name": "get_weather",
                                                                                        "arguments": "{city: Paris"}}]}]},
     "messages", "are not valid JSON"),
    ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [CALL | {"function": {"name": "get_weather",
                                                                                        "arguments": "[1]"}}]}]},
     "messages", "must be a JSON object"),
    ({"messages": [*QUESTION, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "messages",
     "answers no tool call"),
    ({"messages": [*QUESTION, {"role": "tool", "content": "x"}]}, "messages", "needs `tool_call_id`"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]}, "messages", "only assistant messages"),
]


@pytest.mark.parametrize("fields,param,message", BAD_REQUESTS)
def test_bad_tool_requests_are_400(tools_server, fields, param, message):
    r = httpx.post(tools_server.url + "/v1/chat/completions", json={"model": "tiny", "messages": QUESTION} | fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and (message is None or message in error["message"]), error


def test_auto_without_a_parser_is_400(tiny_server):
    """SmolLM2's own template names no tool format: auto cannot be read, and says how to fix it."""
    r = httpx.post(tiny_server.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": QUESTION, "tools": [WEATHER_TOOL]})
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]


def test_clients_send_tools(tools_server):
    """LangChain's bind_tools and huggingface_hub's chat_completion(tools=...) get an answer."""
    from huggingface_hub import InferenceClient
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=tools_server.url + "/v1", api_key="none", model="tiny", temperature=0, max_tokens=8)
    reply = llm.bind_tools([WEATHER_TOOL]).invoke("What is the weather in Paris?")
    assert reply.tool_calls == [] and isinstance(reply.content, str)
    hf = InferenceClient(base_url=tools_server.url)
    out = hf.chat_completion(QUESTION, tools=[WEATHER_TOOL], max_tokens=8, temperature=0)
    assert out.choices[0].message.role == "assistant" and not out.choices[0].message.tool_calls
