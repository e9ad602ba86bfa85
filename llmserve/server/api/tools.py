"""Tool calling on /v1/chat/completions: the request fields, their checks, and what a request's
``tool_choice`` makes of its answer.

- ``none``: the tools stay out of the prompt and the answer is text.
- ``auto`` (the default with tools): the tools are in the prompt; the model may call them in its
  own format, which the server's tool-call parser reads (``--tool-call-parser``, or the one the
  chat template implies).
- ``required``: the answer is constrained to a JSON array of calls to the given tools.
- a named function: the answer is constrained to that function's arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
from pydantic import ConfigDict

from llmserve.sampling_params import GuidedDecodingParams
from llmserve.server.api.errors import require, validation_error
from llmserve.server.api.schema import APIModel
from llmserve.tool_parsers import FunctionCall, NamedParser, RequiredParser, ToolCallStream, ToolParser

# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128                      # OpenAI's limit
LATEST_DRAFT = jsonschema.Draft202012Validator


class FunctionDefinition(APIModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(APIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(APIModel):
    name: str


class NamedToolChoice(APIModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(APIModel):
    name: str
    arguments: str


class ToolCall(APIModel):
    """A call in an assistant message of the conversation."""
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    """Names OpenAI allows, each once; parameters that are a JSON schema; a tool_choice that
    names one of the tools, and only with tools."""
    if tools is None:
        require(tool_choice is None, "`tool_choice` is only allowed when `tools` are given", "tool_choice")
        return
    require(1 <= len(tools) <= MAX_TOOLS, f"`tools` must hold 1 to {MAX_TOOLS} functions, got {len(tools)}", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        f = tool.function
        require(FUNCTION_NAME.fullmatch(f.name) is not None,
               f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-', got {f.name!r}", "tools")
        require(f.name not in names, f"two tools are named {f.name!r}", "tools")
        names.add(f.name)
        if f.parameters is not None:
            problem = schema_problem(f.parameters)
            require(problem is None, f"tools[{i}].function.parameters is not a valid JSON schema: {problem}", "tools")
    if isinstance(tool_choice, NamedToolChoice):
        require(tool_choice.function.name in names,
               f"tool_choice names the function {tool_choice.function.name!r}, which is not among the tools "
               f"({', '.join(sorted(names)) or 'none'})", "tool_choice")


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` is not a JSON schema (checked against its metaschema only: nothing it
    refers to is fetched), or None."""
    try:
        # a schema without $schema is read as the latest draft; an unknown $schema is refused
        validator = jsonschema.validators.validator_for(schema, default=None if "$schema" in schema else LATEST_DRAFT)
        if validator is None:
            return f"unknown $schema {schema.get('$schema')!r}"
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        return e.message
    except (TypeError, ValueError, RecursionError) as e:     # a $schema that is no name, nesting too deep
        return f"{type(e).__name__}: {e}"
    return None


def check_tool_messages(messages: list[Any]) -> None:
    """Calls only in assistant messages, with JSON-object arguments; a tool message answers a
    call made earlier in the conversation."""
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls is not None:
            require(m.role == "assistant", f"messages[{i}]: only assistant messages have tool_calls", "messages")
            for call in m.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError as e:
                    raise validation_error(f"messages[{i}]: the arguments of tool call {call.id!r} are not valid "
                                           f"JSON: {e}", "messages") from None
                require(isinstance(arguments, dict),
                       f"messages[{i}]: the arguments of tool call {call.id!r} must be a JSON object", "messages")
                call_ids.add(call.id)
        if m.role == "tool":
            require(m.tool_call_id is not None, f"messages[{i}]: a tool message needs `tool_call_id`", "messages")
            require(m.tool_call_id in call_ids,
                   f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no tool call of an earlier assistant "
                   "message", "messages")


def template_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls as chat templates take them: ``arguments`` as an object, which Jinja templates write
    with ``tojson`` (a string would come out quoted twice)."""
    return [{"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in calls]


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools and tool_choice mean for its prompt, decoding and answer."""
    tools: list[dict[str, Any]]                      # for the chat template
    parser: ToolParser
    guided_decoding: GuidedDecodingParams | None     # required / named: the answer is constrained
    max_calls: int | None                            # 1 with parallel_tool_calls=false

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.parser, self.max_calls)

    def parse(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        answer = self.parser.parse(text)
        calls = list(answer.calls if self.max_calls is None else answer.calls[:self.max_calls])
        return (answer.content if calls else text), calls


def tool_use(tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None,
             auto_parser: ToolParser | None) -> ToolUse | None:
    """None: the answer is plain text (no tools, or tool_choice "none")."""
    if not tools or tool_choice == "none":
        return None
    max_calls = 1 if parallel_tool_calls is False else None
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if tool_choice in (None, "auto"):
        require(auto_parser is not None, "this server cannot read tool calls in the model's answers: start it with "
                                        "--tool-call-parser NAME, or use tool_choice \"required\" or a named function",
               "tool_choice")
        return ToolUse(template_tools, auto_parser, None, max_calls)
    if tool_choice == "required":
        schema = required_calls_schema(tools, max_calls)
        return ToolUse(template_tools, RequiredParser(), GuidedDecodingParams(json=json.dumps(schema)), max_calls)
    [tool] = [t for t in tools if t.function.name == tool_choice.function.name]
    schema = arguments_schema(tool.function)
    return ToolUse(template_tools, NamedParser(tool.function.name), GuidedDecodingParams(json=json.dumps(schema)), 1)


# OpenAI: "Omitting parameters defines a function with an empty parameter list."
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# Keywords by which a schema says itself what an object's other keys may be.
OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def arguments_schema(function: FunctionDefinition) -> dict[str, Any]:
    """The schema a constrained call's arguments are decoded under: the function's parameters, with
    no keys beyond the declared ones unless the schema says otherwise (or ``strict`` is false).

    JSON Schema lets an object hold any other key, and tool schemas rarely forbid them (pydantic's
    and LangChain's do not); decoding under such a schema let SmolLM2-135M write an undeclared
    ``"description"`` key again and again until the length limit. A function's caller wants its
    declared arguments, so other keys are closed off at the top level, as OpenAI's strict mode
    requires schemas to do."""
    if function.parameters is None:
        return NO_ARGUMENTS
    schema = function.parameters
    if (function.strict is not False and "properties" in schema
            and not any(key in schema for key in OTHER_KEYS)):
        return schema | {"additionalProperties": False}
    return schema


def required_calls_schema(tools: list[Tool], max_calls: int | None) -> dict[str, Any]:
    """A JSON array of at least one ``{"name": ..., "arguments": {...}}``, each naming a tool and
    holding arguments valid for it (`arguments_schema`)."""
    calls = [{"type": "object",
              "properties": {"name": {"const": t.function.name}, "arguments": arguments_schema(t.function)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def tool_call_json(call: FunctionCall, index: int | None = None) -> dict[str, Any]:
    """A call as OpenAI writes it in a message (``index`` in a stream's delta)."""
    entry = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index} | entry
