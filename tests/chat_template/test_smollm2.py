"""The embedded SmolLM2: our rendering equals the tokenizer's own apply_chat_template, as text
and as the token ids the server prompts with."""

import pytest

from llmserve.chat_template import CHAT_TEMPLATES, ChosenTemplate, choose_chat_template

CONVERSATIONS = {
    "one user message": [{"role": "user", "content": "What is the capital of France?"}],
    "system and user": [{"role": "system", "content": "Answer in one word."},
                        {"role": "user", "content": "What is the capital of France?"}],
    "multi-turn": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Name a colour."}],
    "multi-turn with system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
                               {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    "unicode and newlines": [{"role": "user", "content": "Traduis « bonjour » en 日本語\nmerci"}],
    "empty user message": [{"role": "user", "content": ""}],
}


def reference_ids(tokenizer, conversation) -> list[int]:
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    return ids["input_ids"] if hasattr(ids, "keys") else ids     # transformers 5 returns a BatchEncoding


@pytest.fixture(scope="module")
def templates(smollm2_tokenizer):
    return {
        "smollm": ChosenTemplate(CHAT_TEMPLATES.get("smollm")(), "smollm", "registry"),
        "served by default": choose_chat_template(None, smollm2_tokenizer, "SmolLM2-135M-Instruct.Q4_1.gguf"),
    }


@pytest.mark.parametrize("which", ["smollm", "served by default"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_rendering_equals_apply_chat_template(smollm2_tokenizer, templates, which, conversation):
    messages = CONVERSATIONS[conversation]
    chosen = templates[which]
    assert chosen.render(messages) == smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                                             add_generation_prompt=True)
    assert chosen.encode(smollm2_tokenizer, messages) == reference_ids(smollm2_tokenizer, messages)


def test_the_embedded_model_is_served_with_its_own_template(templates):
    assert templates["served by default"].source == "tokenizer"
