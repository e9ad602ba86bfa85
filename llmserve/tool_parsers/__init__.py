"""Tool-call parsers: a model's answer -> content and function calls (see base.py)."""

from llmserve.tool_parsers.base import TOOL_PARSERS, FunctionCall, ParsedAnswer, ToolCallStream, ToolParser
from llmserve.tool_parsers.formats import (
    NamedParser, RequiredParser, parser_for_template_source, tool_parser, tool_parser_names,
)

__all__ = [
    "TOOL_PARSERS", "FunctionCall", "NamedParser", "ParsedAnswer", "RequiredParser", "ToolCallStream", "ToolParser",
    "parser_for_template_source", "tool_parser", "tool_parser_names",
]
