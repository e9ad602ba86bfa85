"""A Jinja chat template (the model's own, or a file), rendered by transformers' apply_chat_template."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmserve.chat_template.base import BaseTemplate, ChatTemplateError, Message, Messages

# Stands for an earlier answer's content in JinjaTemplate.continuation: text no answer holds.
_ANSWER_MARKER = "\u2063llmserve-answer\u2063"


@dataclass
class JinjaTemplate(BaseTemplate):
    """Whole conversations through a Hugging Face style Jinja template. It brings no generation
    defaults (its sampling fields are None: the request's or the server's apply) and no
    session_len; its stop is the tokenizer's EOS."""
    source: str = ""
    tokenizer: Any = field(default=None, repr=False, compare=False)   # gives bos_token and friends to the template
    session_len: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None

    # The template writes the special tokens (a BOS included) itself.
    add_special_tokens: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            ImmutableSandboxedEnvironment().parse(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None

    def decorate_prompt(self, prompt: str, sequence_start: bool = True) -> str:
        return self.messages2prompt([{"role": "user", "content": prompt}], sequence_start)

    def messages2prompt(self, messages: Messages, sequence_start: bool = True,
                        tools: Sequence[dict[str, Any]] | None = None) -> str:
        if isinstance(messages, str):
            return self.get_prompt(messages, sequence_start)
        if not sequence_start:
            raise ChatTemplateError("a Jinja chat template renders whole conversations (sequence_start=True only)")
        if self.tokenizer is None:
            raise RuntimeError("JinjaTemplate.tokenizer is not set")
        try:
            return self.tokenizer.apply_chat_template([dict(m) for m in messages], chat_template=self.source,
                                                      tools=list(tools) if tools else None, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:   # the template's raise_exception(), or a message it cannot handle
            raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from None

    def continuation(self, messages: Sequence[Message]) -> str:
        """A Jinja template renders only whole conversations, so the continuation is read off one:
        a stand-in exchange whose answer is a marker, then ``messages``; what follows the marker is
        the answer's end, the new turns and the next answer's opening, as the template writes them
        after any answer."""
        stand_in = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ANSWER_MARKER}]
        text = self.messages2prompt([*stand_in, *messages])
        if text.count(_ANSWER_MARKER) != 1:
            raise ChatTemplateError("the chat template does not write an earlier answer's content as it is, "
                                    "so a conversation cannot be continued in it")
        return text.split(_ANSWER_MARKER, 1)[1]
