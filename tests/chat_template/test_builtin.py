"""Each built-in template against literal text: the seed's strings for InternLM, the format each
model card documents for the others (without the leading BOS, which the tokenizer adds)."""

import pytest

from llmserve.chat_template import CHAT_TEMPLATES, BaseTemplate, ChatTemplateError, RoleTemplate

INTERNLM_SYSTEM = """<|System|>:You are an AI assistant whose name is InternLM (书生·浦语).
- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI Laboratory (上海人工智能实验室). It is designed to be helpful, honest, and harmless.
- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the user such as English and 中文.

"""  # noqa: E501

CONVERSATION = [
    {"role": "system", "content": "SYS"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]

# name -> (first turn of "hi", a later turn of "hi", CONVERSATION, CONVERSATION without its system message)
EXPECTED = {
    "internlm-chat-7b": (
        INTERNLM_SYSTEM + "<|User|>:hi\n<|Bot|>:",
        "\n<|User|>:hi\n<|Bot|>:",
        "<|System|>:SYS\n<|User|>:U1\n<|Bot|>:A1<eoa>\n<|User|>:U2\n<|Bot|>:",
        INTERNLM_SYSTEM + "<|User|>:U1\n<|Bot|>:A1<eoa>\n<|User|>:U2\n<|Bot|>:",
    ),
    "llama2": (
        "[INST] hi [/INST]",
        "<s>[INST] hi [/INST]",
        "[INST] <<SYS>>\nSYS\n<</SYS>>\n\nU1 [/INST] A1 </s><s>[INST] U2 [/INST]",
        "[INST] U1 [/INST] A1 </s><s>[INST] U2 [/INST]",
    ),
    "llama3": (
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|start_header_id|>system<|end_header_id|>\n\nSYS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU1<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|start_header_id|>user<|end_header_id|>\n\nU1<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "chatml": (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n",
    ),
    "mistral": (
        "[INST] hi [/INST]",
        "[INST] hi [/INST]",
        "[INST] SYS\n\nU1 [/INST] A1</s>[INST] U2 [/INST]",
        "[INST] U1 [/INST] A1</s>[INST] U2 [/INST]",
    ),
    "gemma": (
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
        "\n<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
        "<start_of_turn>user\nSYS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
        "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n",
        "<start_of_turn>user\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
        "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n",
    ),
    "vicuna": (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: hi ASSISTANT:",
        "USER: hi ASSISTANT:",
        "SYS USER: U1 ASSISTANT: A1</s>USER: U2 ASSISTANT:",
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: U1 ASSISTANT: A1</s>USER: U2 ASSISTANT:",
    ),
    "llava": (
        "A chat between a curious human and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the human's questions. USER: hi ASSISTANT:",
        "USER: hi ASSISTANT:",
        "SYS USER: U1 ASSISTANT: A1</s>USER: U2 ASSISTANT:",
        "A chat between a curious human and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the human's questions. USER: U1 ASSISTANT: A1</s>USER: U2 ASSISTANT:",
    ),
}
# Aliases and templates that differ from another only in their defaults render the same text.
EXPECTED["qwen"] = EXPECTED["chatml"]
EXPECTED["internlm-chat-7b-8k"] = EXPECTED["internlm-chat-20b"] = EXPECTED["internlm-chat-7b"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_first_and_later_turn(name):
    first, later, _, _ = EXPECTED[name]
    template = CHAT_TEMPLATES.get(name)()
    assert template.get_prompt("hi") == first
    assert template.get_prompt("hi", sequence_start=True) == first
    assert template.get_prompt("hi", sequence_start=False) == later
    # a string given to messages2prompt is one user prompt
    assert template.messages2prompt("hi") == first
    assert template.messages2prompt("hi", sequence_start=False) == later


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_conversation(name):
    _, _, with_system, without_system = EXPECTED[name]
    template = CHAT_TEMPLATES.get(name)()
    assert template.messages2prompt(CONVERSATION) == with_system
    assert template.messages2prompt(CONVERSATION[1:]) == without_system
    # one user message renders as get_prompt does, in both kinds of turn
    for start in (True, False):
        assert template.messages2prompt([{"role": "user", "content": "hi"}], start) == template.get_prompt("hi", start)


def test_the_seeds_internlm_example():
    prompt = CHAT_TEMPLATES.get("internlm-chat-7b")().get_prompt("你叫什么名字？")
    assert prompt == (
        "<|System|>:You are an AI assistant whose name is InternLM (书生·浦语).\n"
        "- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI Laboratory "
        "(上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n"
        "- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the user such as "
        "English and 中文.\n\n<|User|>:你叫什么名字？\n<|Bot|>:")


def test_the_seeds_defaults():
    base = BaseTemplate()
    assert (base.session_len, base.top_p, base.top_k, base.temperature, base.repetition_penalty, base.capability,
            base.stop_words) == (2048, 0.8, None, 0.8, 1.0, "chat", None)
    internlm_20b = CHAT_TEMPLATES.get("internlm-20b")()
    assert (internlm_20b.session_len, internlm_20b.capability, internlm_20b.top_p) == (4096, "completion", 0.8)
    chat_7b = CHAT_TEMPLATES.get("internlm-chat-7b")()
    assert (chat_7b.system, chat_7b.user, chat_7b.eoh, chat_7b.eosys, chat_7b.assistant) == (
        "<|System|>:", "<|User|>:", "\n", "\n", "<|Bot|>:")
    assert chat_7b.stop_words == ["<eoa>"] and chat_7b.session_len == 2048
    for name in ("internlm-chat-7b-8k", "internlm-chat-20b"):
        assert CHAT_TEMPLATES.get(name)().session_len == 8192
    # the stop words list is each instance's own
    chat_7b.stop_words.append("x")
    assert CHAT_TEMPLATES.get("internlm-chat-7b")().stop_words == ["<eoa>"]


def test_base_models_continue_plain_text():
    for name in ("internlm-7b", "internlm-20b"):
        template = CHAT_TEMPLATES.get(name)()
        assert template.get_prompt("The capital of France is") == "The capital of France is"
        assert template.get_prompt("more", sequence_start=False) == "more"
        with pytest.raises(ChatTemplateError, match="base model"):
            template.messages2prompt([{"role": "user", "content": "hi"}])


def test_a_chat_template_with_capability_completion_leaves_prompts_alone():
    template = CHAT_TEMPLATES.get("internlm-chat-7b")(capability="completion")
    assert template.get_prompt("hi") == "hi"
    with pytest.raises(ChatTemplateError, match="capability 'completion'"):
        template.messages2prompt([{"role": "user", "content": "hi"}])


def test_fields_override_the_defaults():
    template = CHAT_TEMPLATES.get("chatml")(meta_instruction=None, session_len=100, temperature=0.1)
    assert template.get_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (template.session_len, template.temperature, template.top_p) == (100, 0.1, 0.8)
    with pytest.raises(TypeError):
        CHAT_TEMPLATES.get("chatml")(no_such_field=1)
    with pytest.raises(ValueError, match="capability"):
        BaseTemplate(capability="vision")


# ("tool" is a role of the templates with a tool format: tests/chat_template/test_tools.py)
@pytest.mark.parametrize("role", ["wizard", "function", None])
def test_unknown_roles_are_refused(role):
    with pytest.raises(ChatTemplateError, match="unknown role"):
        CHAT_TEMPLATES.get("llama3")().messages2prompt([{"role": role, "content": "x"}])


def test_developer_is_a_system_message():
    template = CHAT_TEMPLATES.get("chatml")()
    as_developer = template.messages2prompt([{"role": "developer", "content": "D"}, {"role": "user", "content": "U"}])
    as_system = template.messages2prompt([{"role": "system", "content": "D"}, {"role": "user", "content": "U"}])
    assert as_developer == as_system


def test_content_must_be_text_or_text_and_image_parts():
    chatml = CHAT_TEMPLATES.get("chatml")()
    for content in ({"text": "x"}, [{"type": "audio"}], [{"type": "text"}]):
        with pytest.raises(ChatTemplateError, match="text"):
            chatml.messages2prompt([{"role": "user", "content": content}])
    # parts: text as it is, an image as the template's placeholder (LLaVA's with its newline)
    parts = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    assert "<|im_start|>user\n<image>What is this?<|im_end|>" in chatml.messages2prompt([{"role": "user", "content": parts}])
    assert "USER: <image>\nWhat is this? ASSISTANT:" in CHAT_TEMPLATES.get("llava")().messages2prompt(
        [{"role": "user", "content": parts}])
    # an assistant turn without content (a tool call) renders as empty
    assert "assistant\n<|im_end|>" in CHAT_TEMPLATES.get("chatml")().messages2prompt(
        [{"role": "user", "content": "U"}, {"role": "assistant", "content": None}, {"role": "user", "content": "V"}])


def test_a_role_template_from_fields_alone():
    template = RoleTemplate(user="Q: ", eoh="\n", assistant="A:", answer_lead=" ", eoa="\n", separator="\n")
    conversation = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                    {"role": "user", "content": "2+2?"}]
    assert template.messages2prompt(conversation) == "Q: 1+1?\nA: 2\n\nQ: 2+2?\nA:"
