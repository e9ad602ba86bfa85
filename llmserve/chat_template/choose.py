"""Which chat template a model is served with.

``--chat-template`` takes a registry name, a JSON file of a template's fields, or a Jinja file.
Without it: the tokenizer's own Jinja template; else a registry template matched from the model's
path and config; else none, and chat requests are refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pydantic

from llmserve.chat_template.base import BaseTemplate, Messages, RoleTemplate
from llmserve.chat_template.builtin import CHAT_TEMPLATES
from llmserve.chat_template.jinja import JinjaTemplate
from llmserve.sampling_params import SamplingParams

TemplateSource = Literal["registry", "json", "jinja", "tokenizer", "matched"]
JINJA_SUFFIXES = (".jinja", ".jinja2", ".j2")

# Model names -> registry templates, for a model that ships no template of its own. Searched in
# the lower-cased model path and config name; the first match wins, so specific names come first.
MODEL_NAME_PATTERNS: list[tuple[str, str]] = [
    (r"internlm-chat-20b", "internlm-chat-20b"),
    (r"internlm-chat-7b-8k", "internlm-chat-7b-8k"),
    (r"internlm-chat-7b", "internlm-chat-7b"),
    (r"internlm-20b", "internlm-20b"),
    (r"internlm-7b", "internlm-7b"),
    (r"llama-?2.*chat", "llama2"),
    (r"llama-?3.*instruct", "llama3"),
    (r"llava", "llava"),
    (r"vicuna", "vicuna"),
    (r"(mistral|mixtral).*instruct", "mistral"),
    (r"gemma.*-it\b", "gemma"),
    (r"qwen.*(chat|instruct)", "qwen"),
    (r"smollm.*instruct", "smollm"),
]


class ChatTemplateConfigError(ValueError):
    """A --chat-template value that cannot be used: the server does not start."""


@dataclass(frozen=True)
class StopWords:
    """A template's stop words, split by how the engine can watch for them: a word that is one
    token of the vocabulary (a special token such as <|im_end|>, whose text a decoded answer never
    shows) stops by id, any other by text."""
    texts: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()

    def add_to(self, params: SamplingParams) -> SamplingParams:
        """``params`` that also stop at these words."""
        if not (self.texts or self.token_ids):
            return params
        return dataclasses.replace(params, stop=[*params.stop, *self.texts],
                                   stop_token_ids=[*params.stop_token_ids, *self.token_ids])


@dataclass(frozen=True)
class ChosenTemplate:
    template: BaseTemplate
    name: str                      # a registry name, a file's name, or "tokenizer"
    source: TemplateSource

    def render(self, messages: Messages, tools: Sequence[dict[str, Any]] | None = None) -> str:
        return self.template.messages2prompt(messages, tools=tools)

    def encode(self, tokenizer: Any, messages: Messages, tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        text = self.render(messages, tools)
        return tokenizer(text, add_special_tokens=self.template.add_special_tokens).input_ids

    def stop_words(self, tokenizer: Any) -> StopWords:
        texts, ids = [], []
        for word in self.template.stop_words or []:
            token_ids = tokenizer(word, add_special_tokens=False).input_ids
            if len(token_ids) == 1:
                ids.append(token_ids[0])
            else:
                texts.append(word)
        return StopWords(tuple(texts), tuple(ids))

    def describe(self) -> dict[str, Any]:
        """What /info shows."""
        t = self.template
        return {"name": self.name, "source": self.source, "session_len": t.session_len, "stop_words": t.stop_words}


def load_chat_template(spec: str) -> ChosenTemplate:
    """``--chat-template``'s value -> a template; a Jinja one is bound to the tokenizer later
    (``choose_chat_template``). Raises ChatTemplateConfigError with a message for the operator."""
    suffix = os.path.splitext(spec)[1].lower()
    if suffix == ".json":
        return ChosenTemplate(template_from_json(_read(spec), spec), os.path.basename(spec), "json")
    # A built-in name wins over a file of that name in the working directory; any other file is Jinja.
    if spec in CHAT_TEMPLATES and suffix not in JINJA_SUFFIXES:
        return ChosenTemplate(CHAT_TEMPLATES.get(spec)(), spec, "registry")
    if suffix in JINJA_SUFFIXES or os.path.isfile(spec):
        try:
            template = JinjaTemplate(source=_read(spec))
        except ValueError as e:
            raise ChatTemplateConfigError(f"{spec}: {e}") from None
        return ChosenTemplate(template, os.path.basename(spec), "jinja")
    raise ChatTemplateConfigError(
        f"unknown chat template {spec!r}: not a file, and not a built-in template "
        f"(known: {', '.join(CHAT_TEMPLATES.names())}; or pass a .json or .jinja file)")


def template_from_json(text: str, path: str) -> BaseTemplate:
    """A JSON object of template fields. ``model_name`` picks the registry template to start from
    (as in LMDeploy's JSON files); without it the fields describe a RoleTemplate from scratch."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ChatTemplateConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ChatTemplateConfigError(f"{path} must hold a JSON object of template fields")
    base_name = fields.pop("model_name", None)
    if base_name is not None and not isinstance(base_name, str):
        raise ChatTemplateConfigError(f"{path}: model_name must be the name of a built-in template, got {base_name!r}")
    try:
        cls = CHAT_TEMPLATES.get(base_name) if base_name is not None else RoleTemplate
    except KeyError as e:
        raise ChatTemplateConfigError(f"{path}: model_name: {e}") from None
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ChatTemplateConfigError(f"{path}: unknown field(s) {', '.join(unknown)}; "
                                      f"a {cls.__name__} has model_name, {', '.join(known)}")
    try:
        return pydantic.TypeAdapter(cls).validate_python(fields)
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'template'}: {err['msg']}" for err in e.errors())
        raise ChatTemplateConfigError(f"{path}: {problems}") from None


def choose_chat_template(chosen: ChosenTemplate | None, tokenizer: Any, model_path: str) -> ChosenTemplate | None:
    """The template to serve: the one --chat-template loaded (a Jinja one bound to the tokenizer),
    else the tokenizer's own, else a registry match for the model's name, else None."""
    if chosen is not None:
        if isinstance(chosen.template, JinjaTemplate):
            return dataclasses.replace(chosen, template=dataclasses.replace(chosen.template, tokenizer=tokenizer))
        return chosen
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):          # a tokenizer with several named templates
        own = own.get("default")
    if own:
        return ChosenTemplate(JinjaTemplate(source=own, tokenizer=tokenizer), "tokenizer", "tokenizer")
    name = match_chat_template(model_name_hints(model_path))
    if name is not None:
        return ChosenTemplate(CHAT_TEMPLATES.get(name)(), name, "matched")
    return None


def match_chat_template(hints: list[str]) -> str | None:
    text = " ".join(hints).lower().replace("_", "-")
    for pattern, name in MODEL_NAME_PATTERNS:
        if re.search(pattern, text):
            return name
    return None


def model_name_hints(model_path: str) -> list[str]:
    """What names the model: its file or directory name, and the name and type its config.json records."""
    hints = [os.path.basename(model_path.rstrip(os.sep)).removesuffix(".gguf")]
    config_path = os.path.join(model_path, "config.json")
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = {}
        hints += [str(config.get(k)) for k in ("_name_or_path", "model_type") if config.get(k)]
    return hints


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ChatTemplateConfigError(f"cannot read the chat template {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ChatTemplateConfigError(f"cannot read the chat template {path!r}: it is not UTF-8 text") from None
