"""The template classes: ``BaseTemplate`` (LMDeploy's design: a chat format plus the generation
defaults that belong to a model) and ``RoleTemplate``, the role-prefix/suffix format every
built-in chat template is an instance of.

A rendered prompt leaves the sequence-start BOS to the tokenizer (the server encodes it with
``add_special_tokens=True``); special tokens inside the conversation (Llama 2's ``</s><s>``
between turns) are written as text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from llmserve.sampling_params import check_ranges

if TYPE_CHECKING:
    from llmserve.chat_template.tools import ToolFormat

Message = Mapping[str, Any]          # OpenAI's {"role": ..., "content": ...}
Messages = str | Sequence[Message]

CAPABILITIES = ("chat", "completion")


class ChatTemplateError(ValueError):
    """A conversation the template cannot render (an unknown role, a base model's template):
    the caller's input is at fault, not the server."""


@dataclass
class BaseTemplate:
    """Generation defaults of a model, and the identity prompt format of a base model.

    ``capability='completion'`` marks a base model: ``get_prompt`` returns the prompt unchanged
    and a conversation cannot be rendered. The sampling fields are defaults: a request's own
    values and the model's win (``SamplingDefaults.resolve``); their ranges are SamplingParams'.
    """
    session_len: int = 2048                 # the longest sequence (prompt + answer) the model is meant for
    top_p: float = 0.8
    top_k: int | None = None
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    capability: str = "chat"
    stop_words: list[str] | None = None     # texts that end an answer, beside the tokenizer's EOS

    # How the server tokenizes a rendered prompt: these templates leave the BOS to the tokenizer.
    add_special_tokens: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.capability not in CAPABILITIES:
            raise ValueError(f"capability must be one of {', '.join(CAPABILITIES)}, got {self.capability!r}")
        if self.session_len is not None and self.session_len < 2:
            raise ValueError(f"session_len must be >= 2, got {self.session_len}")
        check_ranges({name: value for name in ("top_p", "temperature", "top_k", "repetition_penalty")
                      if (value := getattr(self, name)) is not None})
        if self.stop_words is not None and not all(isinstance(w, str) and w for w in self.stop_words):
            raise ValueError("stop_words must be non-empty strings")

    def get_prompt(self, prompt: str, sequence_start: bool = True) -> str:
        """The text to send for one user prompt; ``sequence_start`` marks the first turn of a
        session, later turns continue a sequence whose history the server already holds."""
        if self.capability == "completion":
            return prompt
        return self.decorate_prompt(prompt, sequence_start)

    def decorate_prompt(self, prompt: str, sequence_start: bool = True) -> str:
        return prompt

    def messages2prompt(self, messages: Messages, sequence_start: bool = True,
                        tools: Sequence[dict[str, Any]] | None = None) -> str:
        """A string is one user prompt (``get_prompt``); a list is an OpenAI conversation, which may
        come with OpenAI's ``tools`` (function definitions) for the prompt."""
        if isinstance(messages, str):
            return self.get_prompt(messages, sequence_start)
        raise ChatTemplateError(f"the {type(self).__name__} template is a base model's: it has no chat format "
                                "to render a conversation in")

    def continuation(self, messages: Sequence[Message]) -> str:
        """The text that continues a conversation right after the content of the answer last
        generated in it: that answer's end (which the model may not have written: an answer cut by
        its length limit), then ``messages``, ending where the next answer starts. An interactive
        session appends its tokens to the tokens the engine saw (server/sessions.py)."""
        raise ChatTemplateError(f"the {type(self).__name__} template is a base model's: it has no chat format "
                                "to continue a conversation in")


# OpenAI's role names -> the template's three roles; "developer" is OpenAI's newer name for "system".
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class RoleTemplate(BaseTemplate):
    """A chat format made of fixed texts around each message:

        {system}{system message}{eosys}  {user}{user message}{eoh}
        {assistant}{answer_lead}{answer}{eoa}{separator}  ...  {assistant}

    The prompt ends with ``assistant``: the model writes the answer from there. A conversation
    without a system message gets ``meta_instruction`` in its place (None: nothing).
    """
    system: str = ""
    meta_instruction: str | None = None
    eosys: str = ""
    user: str = ""
    eoh: str = ""                  # end of a user ("human") message
    assistant: str = ""
    answer_lead: str = ""          # before an answer from the history: the space a generated answer's first token carries
    eoa: str = ""                  # end of an answer: normally the stop word the model emits
    separator: str = ""            # after an answer, before the next turn
    system_in_first_user: bool = False   # Llama 2 and Mistral put the system text inside the first user turn
    image: str = "<image>"         # what an image part of a message renders as (the model's placeholder)

    # How tools, calls and tool results are written (chat_template/tools.py); None: the format has none.
    tool_format: ClassVar[ToolFormat | None] = None

    def decorate_prompt(self, prompt: str, sequence_start: bool = True) -> str:
        return self.messages2prompt([{"role": "user", "content": prompt}], sequence_start)

    def messages2prompt(self, messages: Messages, sequence_start: bool = True,
                        tools: Sequence[dict[str, Any]] | None = None) -> str:
        """``sequence_start=False`` continues a sequence: no meta_instruction, and the text starts
        with the separator that follows the previous answer's stop word."""
        if isinstance(messages, str):
            return self.get_prompt(messages, sequence_start)
        if self.capability != "chat":
            raise ChatTemplateError(f"the {type(self).__name__} template is for a base model "
                                    f"(capability {self.capability!r}): it cannot render a conversation")
        turns = self._turns(messages, tools)
        if sequence_start and self.meta_instruction is not None and (not turns or turns[0][0] != "system"):
            turns.insert(0, ("system", self.meta_instruction))
        text = "" if sequence_start else self.separator
        pending_system = ""        # a system block waiting for the user turn it belongs in
        for role, content in turns:
            if role == "system":
                pending_system += f"{self.system}{content}{self.eosys}"
                if not self.system_in_first_user:
                    text, pending_system = text + pending_system, ""
            elif role == "user":
                text += f"{self.user}{pending_system}{content}{self.eoh}"
                pending_system = ""
            elif role == "verbatim":           # a tool format's own turn (a tool result, the tool list)
                text += content
            else:
                text += f"{pending_system}{self.assistant}{self.answer_lead}{content}{self.eoa}{self.separator}"
                pending_system = ""
        return f"{text}{pending_system}{self.assistant}"

    def continuation(self, messages: Sequence[Message]) -> str:
        """The answer's ``eoa`` (the history holds the answer's content only), then the new turns
        rendered with ``sequence_start=False`` (from the separator on)."""
        return self.eoa + self.messages2prompt(messages, sequence_start=False)

    def _turns(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None) -> list[tuple[str, str]]:
        if self.tool_format is not None:
            return self.tool_format.turns(self, messages, tools)
        if tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
            raise ChatTemplateError(f"the {type(self).__name__} template has no format for tools, tool calls or tool "
                                    "results (the chatml/qwen, llama3 and mistral templates have one)")
        return [self._turn(m) for m in messages]

    def _turn(self, message: Message) -> tuple[str, str]:
        role = ROLES.get(message.get("role"))
        if role is None:
            raise ChatTemplateError(f"unknown role {message.get('role')!r}: the {type(self).__name__} template "
                                    f"knows the roles {', '.join(ROLES)}")
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):   # parts: text, and images (see server/api/openai/convert.message_content)
            content = "".join(self._part_text(part, role) for part in content)
        if not isinstance(content, str):
            raise ChatTemplateError(f"the content of a {role} message must be text")
        return role, content

    def _part_text(self, part: Any, role: str) -> str:
        """A content part as text: a text part's text, an image part's placeholder."""
        if isinstance(part, Mapping) and part.get("type") == "image":
            return self.image
        if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            return part["text"]
        raise ChatTemplateError(f"the content of a {role} message must be text, or text and image parts")
