"""Tool calling on /v1/chat/completions end to end: a tiny random Llama served with a Hermes-style
Jinja template that renders tools, driven by the `openai` SDK, LangChain and huggingface_hub.

A random model never calls a tool on its own, so what ``auto`` makes of a call is the parser
tests' business (tests/tool_parsers); here: the request fields, their errors, the tools and the
tool history reaching the prompt, and ``none``."""

from __future__ import annotations

import json
import os
import re

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
    return oai.chat.completions.create(model="tiny", messages=messages, **{"max_tokens": 8, "temperature": 0} | kwargs)


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
    ({"tools": [], "tool_choice": "required"}, "tools", "1 to 128 functions"),
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
    ({"functions": [WEATHER_TOOL["function"]]}, "functions", "use `tools`"),
    ({"function_call": "auto"}, "function_call", "use `tool_choice`"),
]


@pytest.mark.parametrize("fields,param,message", BAD_REQUESTS)
def test_bad_tool_requests_are_400(tools_server, fields, param, message):
    r = httpx.post(tools_server.url + "/v1/chat/completions", json={"model": "tiny", "messages": QUESTION} | fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and (message is None or message in error["message"]), error


def test_auto_without_a_parser_is_400(tiny_server, tools_server):
    """SmolLM2's own template names no tool format: auto cannot be read, and says how to fix it."""
    assert httpx.get(tools_server.url + "/info").json()["tool_call_parser"] == "hermes"    # from the Jinja template
    assert httpx.get(tiny_server.url + "/info").json()["tool_call_parser"] is None
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


# -- constrained choices: the answer is always a call -----------------------------------------

# Arguments with few possible values, so that a random model under the grammar ends its call
# within a few tokens.
FORECAST_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
                       "required": ["city", "unit"], "additionalProperties": False}
FORECAST_TOOL = {"type": "function", "function": {"name": "forecast", "description": "The forecast for a city",
                                                  "parameters": FORECAST_PARAMETERS}}


def assert_forecast_call(call) -> None:
    import jsonschema

    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "forecast"
    jsonschema.validate(json.loads(call.function.arguments), FORECAST_PARAMETERS)


def streamed_calls(chunks) -> tuple[list[dict], str | None]:
    """The calls a stream's deltas add up to (OpenAI clients join them by index), and its finish_reason."""
    calls: dict[int, dict] = {}
    reason = None
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        reason = c.choices[0].finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "forecast"}}],
                         ids=["required", "named"])
def test_constrained_choice_always_calls(oai, tool_choice):
    kwargs = {"tools": [TIME_TOOL, FORECAST_TOOL] if tool_choice == "named" else [FORECAST_TOOL],
              "tool_choice": tool_choice, "parallel_tool_calls": False}
    r = oai.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=40, temperature=0, **kwargs)
    [call] = r.choices[0].message.tool_calls
    assert_forecast_call(call)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    chunks = list(oai.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=40, temperature=0,
                                              stream=True, **kwargs))
    calls, reason = streamed_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert reason == "tool_calls" and calls[0]["id"].startswith("call_")


def test_round_trip_with_the_servers_own_call(oai):
    """The call the server made, the tool's result, and the final answer (text, tool_choice auto)."""
    first = oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[FORECAST_TOOL], tool_choice="required",
                                        max_tokens=40, temperature=0)
    message = first.choices[0].message
    [call] = message.tool_calls
    conversation = [*QUESTION, message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "12 degrees"}]
    final = oai.chat.completions.create(model="tiny", messages=conversation, tools=[FORECAST_TOOL], max_tokens=8,
                                        temperature=0)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content


def test_clients_get_constrained_calls(tools_server):
    """LangChain's bind_tools(tool_choice="any") and with_structured_output(method="function_calling"),
    huggingface_hub's chat_completion(tools=..., tool_choice="required")."""
    from typing import Literal

    from huggingface_hub import InferenceClient
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(base_url=tools_server.url + "/v1", api_key="none", model="tiny", temperature=0, max_tokens=40)
    reply = llm.bind_tools([FORECAST_TOOL], tool_choice="any").invoke("Forecast for Oslo?")
    [call] = reply.tool_calls
    assert call["name"] == "forecast" and call["args"]["city"] in ("Paris", "Oslo")

    class Forecast(BaseModel):
        city: Literal["Paris", "Oslo"]
        unit: Literal["C", "F"]

    # strict: the schema gets additionalProperties false, so the random model cannot add keys forever
    forecast = llm.with_structured_output(Forecast, method="function_calling", strict=True).invoke("Forecast for Oslo?")
    assert isinstance(forecast, Forecast)

    hf = InferenceClient(base_url=tools_server.url)
    out = hf.chat_completion(QUESTION, tools=[FORECAST_TOOL], tool_choice="required", max_tokens=40, temperature=0)
    [hf_call] = out.choices[0].message.tool_calls
    arguments = hf_call.function.arguments     # OpenAI's JSON string (TGI would send an object)
    assert hf_call.function.name == "forecast" and json.loads(arguments)["city"] in ("Paris", "Oslo")
    assert out.choices[0].finish_reason == "tool_calls"


# -- auto and none on an answer that calls: a regex makes the random model write a Hermes call --

FORCED_ANSWER = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FORCED = {"guided_regex": re.escape(FORCED_ANSWER)}


def test_auto_reads_the_models_call(oai):
    kwargs = {"tools": [WEATHER_TOOL], "max_tokens": 60, "extra_body": FORCED}
    r = chat(oai, QUESTION, **kwargs)
    message = r.choices[0].message
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert message.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
    chunks = list(chat(oai, QUESTION, stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me check."
    calls, reason = streamed_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert reason == "tool_calls"


def test_none_leaves_a_call_in_the_text(oai):
    r = chat(oai, QUESTION, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=60, extra_body=FORCED)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == FORCED_ANSWER
    assert r.choices[0].finish_reason == "stop"


def test_a_small_model_writes_only_the_declared_arguments(embedded_server):
    """SmolLM2-135M under tool_choice "required", with a tool schema that says nothing of other keys
    (as pydantic's do): once it wrote an undeclared "description" key over and over until the length
    limit. Other keys are now closed off, so the call ends and holds the declared argument only."""
    client = embedded_server.openai_client(timeout=120)
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION, tools=[WEATHER_TOOL],
                                       tool_choice="required", max_tokens=60, temperature=0)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(call.function.arguments)) <= {"city"}
