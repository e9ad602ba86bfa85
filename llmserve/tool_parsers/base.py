"""What every tool-call parser shares: the parsed call, the JSON scanning, and streaming.

A parser splits a model's answer into the text meant for the user (``content``) and the
function calls it makes. It is written once, as ``split(text, final)``: on a finished answer
(``final``) it returns everything; on an answer still being generated it returns only what can
no longer change (content up to where a call might be starting, calls whose JSON is complete).
``ToolCallStream`` turns successive splits of a growing answer into deltas, so a stream and a
single response always agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from llmserve.chat_template.registry import Registry

TOOL_PARSERS = Registry("tool-call parser")


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str        # a JSON object, serialised (OpenAI's `arguments` is a string)


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    calls: tuple[FunctionCall, ...] = ()


class ToolParser:
    """One model family's way of writing calls into its answer."""
    name: ClassVar[str] = ""

    def split(self, text: str, final: bool) -> ParsedAnswer:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedAnswer:
        return self.split(text, final=True)


def call_from_json(value: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> FunctionCall | None:
    """``{"name": ..., "arguments": {...}}`` -> a call; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):        # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return FunctionCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array opening at ``text[start]``, or None while it
    is incomplete. Only brackets and strings are tracked: ``json.loads`` judges the rest."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan_calls(text: str, pos: int, separator: str, closing: str = "") -> tuple[list[FunctionCall], bool]:
    """Calls written as JSON objects one after another from ``pos``, between ``separator``s
    (``,`` in an array, ``;`` for Llama), up to an optional ``closing`` text. Returns the
    complete calls and whether the text holds nothing else (False: a call that is not one,
    or text that is not a call)."""
    calls: list[FunctionCall] = []
    pos = skip_space(text, pos)
    while pos < len(text):
        if text[pos] != "{":
            return calls, text.startswith(closing, pos) if closing else False
        end = json_value_end(text, pos)
        if end is None:
            return calls, True
        try:
            call = call_from_json(json.loads(text[pos:end]))
        except ValueError:
            call = None
        if call is None:
            return calls, False
        calls.append(call)
        pos = skip_space(text, end)
        if text.startswith(separator, pos):
            pos = skip_space(text, pos + len(separator))
    return calls, True


def held_back(text: str, marker: str) -> str:
    """``text`` without what might be the start of ``marker`` at its end, nor trailing space (a
    call's text usually comes after a newline, which belongs to neither)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            text = text[:-n]
            break
    return text.rstrip()


def content_or_none(text: str) -> str | None:
    return text if text else None


class ToolCallStream:
    """A parser over a growing answer: ``feed`` each new piece of text, and get the content and
    calls that became certain; ``final=True`` with the last piece flushes the rest."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.sent_content = 0
        self.sent_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[FunctionCall]]:
        self.text += text
        answer = self.parser.split(self.text, final)
        content = answer.content or ""
        new_content = content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(content))
        calls = list(answer.calls[:self.max_calls] if self.max_calls is not None else answer.calls)
        new_calls = calls[self.sent_calls:]
        self.sent_calls = len(calls)
        return new_content, new_calls
