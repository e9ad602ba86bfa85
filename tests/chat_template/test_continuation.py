"""``continuation``: what an interactive session appends after an answer's content. A session's
text (the first turn's prompt, then each answer and continuation) must be the whole
conversation's rendering, turn after turn, for every chat template: registry ones (eoa +
``sequence_start=False``) and Jinja ones (read off a rendered stand-in exchange)."""

import pytest

from llmserve.chat_template import CHAT_TEMPLATES, ChatTemplateError, JinjaTemplate, RoleTemplate

TURNS = [("What is 2+2?", "4"), ("And 3+3?", "It is 6.\nSure."), ("Thanks!", "You're welcome")]
CHAT_NAMES = sorted(n for n in CHAT_TEMPLATES.names() if isinstance(CHAT_TEMPLATES.get(n)(), RoleTemplate))


def session_text(template, system: str | None) -> list[str]:
    """Per turn, the text a session has sent by the end of that turn's prompt."""
    first = [{"role": "system", "content": system}] if system else []
    texts, text = [], ""
    for k, (user, _) in enumerate(TURNS):
        if k == 0:
            text = template.messages2prompt([*first, {"role": "user", "content": user}])
        else:
            previous_answer = TURNS[k - 1][1]
            lead = getattr(template, "answer_lead", "")   # a generated answer's first token carries it
            text += lead + previous_answer + template.continuation([{"role": "user", "content": user}])
        texts.append(text)
    return texts


def whole_text(template, system: str | None) -> list[str]:
    """Per turn, the whole conversation up to that turn's question, rendered at once."""
    messages = [{"role": "system", "content": system}] if system else []
    texts = []
    for user, answer in TURNS:
        messages.append({"role": "user", "content": user})
        texts.append(template.messages2prompt(messages))
        messages.append({"role": "assistant", "content": answer})
    return texts


@pytest.mark.parametrize("system", [None, "Be terse."])
@pytest.mark.parametrize("name", CHAT_NAMES)
def test_registry_session_renders_the_whole_conversation(name, system):
    template = CHAT_TEMPLATES.get(name)()
    assert isinstance(template, RoleTemplate)
    assert session_text(template, system) == whole_text(template, system)


@pytest.mark.parametrize("system", [None, "Be terse."])
def test_jinja_session_renders_the_whole_conversation(smollm2_tokenizer, system):
    template = JinjaTemplate(source=smollm2_tokenizer.chat_template, tokenizer=smollm2_tokenizer)
    assert session_text(template, system) == whole_text(template, system)
    # the continuation starts with the answer's end: ChatML's <|im_end|>, then the new turn
    assert template.continuation([{"role": "user", "content": "U"}]) == \
        "<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_answers_cannot_continue(smollm2_tokenizer):
    # writes each answer upper-cased: an earlier answer's content is not as generated
    source = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] | upper }}"
              "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    template = JinjaTemplate(source=source, tokenizer=smollm2_tokenizer)
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        template.continuation([{"role": "user", "content": "U"}])


def test_a_base_model_template_has_no_continuation():
    with pytest.raises(ChatTemplateError):
        CHAT_TEMPLATES.get("internlm-7b")().continuation([{"role": "user", "content": "U"}])
