"""How the built-in chat templates write tools, tool calls and tool results: the format each
model family was trained on (its tags and layout), so that its calls come back in the form its
tool-call parser reads.

A ``ToolFormat`` turns a conversation into the (role, text) turns ``RoleTemplate`` renders:
the tools go where the format keeps them, an assistant's calls become its answer text, and
tool results become turns of their own (role ``verbatim``: written as they are).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from llmserve.chat_template.base import ChatTemplateError, Message

if TYPE_CHECKING:
    from llmserve.chat_template.base import RoleTemplate

Turn = tuple[str, str]
Tools = Sequence[dict[str, Any]]


def call_function(call: dict[str, Any]) -> tuple[str, Any]:
    """A conversation's call (OpenAI's ``{"function": {"name", "arguments"}}``) -> name, arguments."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ChatTemplateError(f"the arguments of tool call {call.get('id')!r} are not valid JSON") from None
    return function.get("name", ""), arguments


def tool_json(tool: dict[str, Any]) -> str:
    return json.dumps(tool, ensure_ascii=False)


class ToolFormat:
    """One family's tool format; ``parser`` names the tool-call parser that reads its calls."""
    parser: ClassVar[str]

    def turns(self, template: RoleTemplate, messages: Sequence[Message], tools: Tools | None) -> list[Turn]:
        turns: list[Turn] = []
        for m in messages:
            if m.get("role") == "tool":
                self.add_result(turns, m)
            elif m.get("role") == "assistant" and m.get("tool_calls"):
                content = m.get("content") or ""
                turns.append(("assistant", self.calls_text(content, [call_function(c) for c in m["tool_calls"]], m)))
            else:
                turns.append(template._turn(m))
        return self.with_tools(template, turns, tools) if tools else turns

    def with_tools(self, template: RoleTemplate, turns: list[Turn], tools: Tools) -> list[Turn]:
        raise NotImplementedError

    def calls_text(self, content: str, calls: list[tuple[str, Any]], message: Message) -> str:
        raise NotImplementedError

    def add_result(self, turns: list[Turn], message: Message) -> None:
        raise NotImplementedError


def _system_with(template: RoleTemplate, turns: list[Turn], text: str) -> list[Turn]:
    """``text`` at the end of the system message (the template's default one if there is none)."""
    if turns and turns[0][0] == "system":
        return [("system", f"{turns[0][1]}\n\n{text}" if turns[0][1] else text), *turns[1:]]
    base = template.meta_instruction
    return [("system", f"{base}\n\n{text}" if base else text), *turns]


class HermesTools(ToolFormat):
    """Hermes 2 Pro / Qwen 2.5: tools as JSON lines in ``<tools>`` in the system message, each call
    a ``<tool_call>`` block in the answer, results in ``<tool_response>`` blocks of a user turn."""
    parser = "hermes"
    RESULT_TURN = "user"

    def with_tools(self, template: RoleTemplate, turns: list[Turn], tools: Tools) -> list[Turn]:
        listing = "\n".join(tool_json(t) for t in tools)
        return _system_with(template, turns, (
            "# Tools\n\nYou may call the functions whose signatures are listed within <tools></tools> tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "To call one, write a JSON object with its name and arguments within <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'))

    def calls_text(self, content: str, calls: list[tuple[str, Any]], message: Message) -> str:
        blocks = [f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                  for n, a in calls]
        return "\n".join([content, *blocks] if content else blocks)

    def add_result(self, turns: list[Turn], message: Message) -> None:
        block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
        # consecutive results share one user turn
        if turns and turns[-1][0] == self.RESULT_TURN and turns[-1][1].endswith("</tool_response>"):
            turns[-1] = (self.RESULT_TURN, f"{turns[-1][1]}\n{block}")
        else:
            turns.append((self.RESULT_TURN, block))


class Llama3JsonTools(ToolFormat):
    """Llama 3.1's JSON tool calling: the tools and how to call them open the first user message;
    a call is ``{"name": ..., "parameters": {...}}``; results are ``ipython`` turns."""
    parser = "llama3_json"

    def with_tools(self, template: RoleTemplate, turns: list[Turn], tools: Tools) -> list[Turn]:
        first_user = next((i for i, (role, _) in enumerate(turns) if role == "user"), None)
        if first_user is None:
            raise ChatTemplateError("with tools, the llama3 template needs a user message to put them in")
        listing = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        preamble = ("You may call one of the functions below. To call it, answer with only a JSON object of the form "
                    '{"name": function name, "parameters": dictionary of argument name and its value}.\n\n'
                    f"{listing}\n\n")
        turns = list(turns)
        turns[first_user] = ("user", preamble + turns[first_user][1])
        return turns

    def calls_text(self, content: str, calls: list[tuple[str, Any]], message: Message) -> str:
        text = "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
        return f"{content}<|python_tag|>{text}" if content else text

    def add_result(self, turns: list[Turn], message: Message) -> None:
        turns.append(("verbatim", f"<|start_header_id|>ipython<|end_header_id|>\n\n{message.get('content') or ''}"
                                  "<|eot_id|>"))


class MistralTools(ToolFormat):
    """Mistral v3: ``[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]`` before the last instruction, calls
    as ``[TOOL_CALLS] [...]``, results as ``[TOOL_RESULTS] {...}[/TOOL_RESULTS]``."""
    parser = "mistral"

    def with_tools(self, template: RoleTemplate, turns: list[Turn], tools: Tools) -> list[Turn]:
        last_user = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=len(turns))
        listing = ", ".join(tool_json(t) for t in tools)
        return [*turns[:last_user], ("verbatim", f"[AVAILABLE_TOOLS] [{listing}][/AVAILABLE_TOOLS]"), *turns[last_user:]]

    def calls_text(self, content: str, calls: list[tuple[str, Any]], message: Message) -> str:
        ids = [c.get("id") for c in message["tool_calls"]]
        entries = [{"name": n, "arguments": a} | ({"id": i} if i else {}) for (n, a), i in zip(calls, ids)]
        text = f"[TOOL_CALLS] {json.dumps(entries, ensure_ascii=False)}"
        return f"{content} {text}" if content else text

    def add_result(self, turns: list[Turn], message: Message) -> None:
        result = {"content": message.get("content") or "", "call_id": message.get("tool_call_id")}
        turns.append(("verbatim", f"[TOOL_RESULTS] {json.dumps(result, ensure_ascii=False)}[/TOOL_RESULTS]"))
