"""Chat templates: how a conversation becomes a prompt, and the generation defaults a model
comes with. ``CHAT_TEMPLATES.get(name)()`` gives a built-in; ``choose_chat_template`` picks the
one a server uses."""

from llmserve.chat_template.base import BaseTemplate, ChatTemplateError, RoleTemplate
from llmserve.chat_template.builtin import CHAT_TEMPLATES
from llmserve.chat_template.choose import (
    ChatTemplateConfigError, ChosenTemplate, StopWords, choose_chat_template, load_chat_template, match_chat_template,
)
from llmserve.chat_template.jinja import JinjaTemplate

__all__ = [
    "CHAT_TEMPLATES", "BaseTemplate", "ChatTemplateConfigError", "ChatTemplateError", "ChosenTemplate",
    "JinjaTemplate", "RoleTemplate", "StopWords", "choose_chat_template", "load_chat_template", "match_chat_template",
]
