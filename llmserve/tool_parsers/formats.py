"""The call formats models are trained on, and the two that constrained decoding writes.

- ``hermes`` (Hermes 2 Pro, Qwen 2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, after any text.
- ``llama3_json`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": {...}}``
  (calls separated by ``;``), or such JSON after ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.
- ``required`` / ``named``: what ``tool_choice`` "required" and a named function make the model
  write under a grammar (a JSON array of calls; the named function's arguments object).
"""

from __future__ import annotations

import json
from typing import ClassVar

from llmserve.tool_parsers.base import (
    TOOL_PARSERS, FunctionCall, ParsedAnswer, ToolParser, content_or_none, held_back, json_value_end, scan_calls,
    skip_space,
)


class MarkerParser(ToolParser):
    """Calls follow a marker; text before the marker is content. A finished answer whose
    marker is followed by no call at all is all content."""
    marker: ClassVar[str]

    def calls_after(self, text: str, start: int) -> list[FunctionCall]:
        """The complete calls in ``text`` from ``start``, where the first marker is."""
        raise NotImplementedError

    def split(self, text: str, final: bool) -> ParsedAnswer:
        start = text.find(self.marker)
        if start < 0:
            return ParsedAnswer(text if final else held_back(text, self.marker))
        calls = self.calls_after(text, start)
        if final and not calls:
            return ParsedAnswer(text)
        return ParsedAnswer(content_or_none(text[:start].rstrip()), tuple(calls))


@TOOL_PARSERS.register_module(name="hermes")
class HermesParser(MarkerParser):
    name = "hermes"
    marker = "<tool_call>"
    closing = "</tool_call>"

    def calls_after(self, text: str, start: int) -> list[FunctionCall]:
        calls: list[FunctionCall] = []
        while start >= 0:
            block, complete = scan_calls(text, start + len(self.marker), separator="\n", closing=self.closing)
            calls += block
            if not complete or not block:
                break
            start = text.find(self.marker, start + len(self.marker))
        return calls


@TOOL_PARSERS.register_module(name="mistral")
class MistralParser(MarkerParser):
    """``[TOOL_CALLS]`` is a special token in Mistral's tokenizers, which a decoded answer normally
    leaves out: an answer that starts with a JSON array of objects is read as calls too (and is
    content after all if it is not)."""
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def calls_after(self, text: str, start: int) -> list[FunctionCall]:
        return self.array_calls(text, start + len(self.marker))[0]

    @staticmethod
    def array_calls(text: str, pos: int) -> tuple[list[FunctionCall], bool]:
        """The calls of an array opening at ``pos`` (after space), and whether the text is (so far) only that."""
        pos = skip_space(text, pos)
        if pos >= len(text) or text[pos] != "[":
            return [], pos >= len(text)
        after = skip_space(text, pos + 1)
        if after < len(text) and text[after] != "{":
            return [], False
        return scan_calls(text, pos + 1, separator=",", closing="]")

    def split(self, text: str, final: bool) -> ParsedAnswer:
        if self.marker in text:
            return super().split(text, final)
        head = text.lstrip()
        if not final and (not head or self.marker.startswith(head)):
            return ParsedAnswer(None)              # the answer may yet turn out to be calls
        calls, only_calls = self.array_calls(text, 0)
        if head.startswith("[") and only_calls and (calls or not final):
            return ParsedAnswer(None, tuple(calls))
        return super().split(text, final)


@TOOL_PARSERS.register_module(name="llama3_json")
class Llama3JsonParser(ToolParser):
    """Llama 3.1's JSON calls. ``<|python_tag|>`` is a special token that a decoded answer
    normally leaves out, so an answer that starts with ``{`` is read as calls too; if it turns
    out not to be calls, it is content after all."""
    name = "llama3_json"
    marker = "<|python_tag|>"

    def split(self, text: str, final: bool) -> ParsedAnswer:
        start = text.find(self.marker)
        if start >= 0:
            content, calls_from = text[:start].rstrip(), start + len(self.marker)
        else:
            head = text.lstrip()
            if not final and (not head or self.marker.startswith(head)):
                return ParsedAnswer(None)          # the answer may yet turn out to be a call
            if not head.startswith("{"):
                return ParsedAnswer(text if final else held_back(text, self.marker))
            content, calls_from = "", 0
        calls, only_calls = scan_calls(text, calls_from, separator=";")
        if final and (not calls or not only_calls):
            return ParsedAnswer(text)
        return ParsedAnswer(content_or_none(content), tuple(calls))


class RequiredParser(ToolParser):
    """tool_choice "required": a JSON array of ``{"name", "arguments"}`` objects, the grammar's
    output (see ``required_calls_schema``)."""
    name = "required"

    def split(self, text: str, final: bool) -> ParsedAnswer:
        pos = skip_space(text, 0)
        if pos < len(text) and text[pos] == "[":
            calls, _ = scan_calls(text, pos + 1, separator=",", closing="]")
            if calls or not final:
                return ParsedAnswer(None, tuple(calls))
        return ParsedAnswer(text if final else None)


class NamedParser(ToolParser):
    """A named tool_choice: the answer is the function's arguments object."""
    name = "named"

    def __init__(self, function_name: str):
        self.function_name = function_name

    def split(self, text: str, final: bool) -> ParsedAnswer:
        pos = skip_space(text, 0)
        end = json_value_end(text, pos) if pos < len(text) and text[pos] == "{" else None
        if end is not None:
            try:
                arguments = json.loads(text[pos:end])
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                return ParsedAnswer(None, (FunctionCall(self.function_name, json.dumps(arguments, ensure_ascii=False)),))
        return ParsedAnswer(text if final else None)


def tool_parser(name: str) -> ToolParser:
    """A parser by its ``--tool-call-parser`` name (KeyError lists the known ones)."""
    return TOOL_PARSERS.get(name)()


def tool_parser_names() -> list[str]:
    return TOOL_PARSERS.names()


# What a Jinja chat template's own text says about the format its model calls tools in.
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))


def parser_for_template_source(source: str) -> str | None:
    for marker, name in _TEMPLATE_MARKERS:
        if marker in source:
            return name
    return None
