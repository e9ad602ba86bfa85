import json

import pytest

from llmserve.chat_template import (
    CHAT_TEMPLATES, ChatTemplateConfigError, ChosenTemplate, JinjaTemplate, RoleTemplate, StopWords,
    choose_chat_template, load_chat_template, match_chat_template,
)
from llmserve.chat_template.choose import model_name_hints


class NoTemplateTokenizer:
    chat_template = None


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# -- --chat-template NAME | FILE.json | FILE.jinja --------------------------------------------

def test_a_registry_name():
    chosen = load_chat_template("llama3")
    assert (chosen.name, chosen.source) == ("llama3", "registry")
    assert chosen.template == CHAT_TEMPLATES.get("llama3")()


def test_an_unknown_name_lists_the_builtins():
    with pytest.raises(ChatTemplateConfigError) as e:
        load_chat_template("llama-9")
    message = str(e.value)
    assert "unknown chat template 'llama-9'" in message
    assert all(name in message for name in CHAT_TEMPLATES.names())


def test_a_json_file_of_fields_over_a_builtin(tmp_path):
    path = write(tmp_path, "terse.json", json.dumps(
        {"model_name": "chatml", "meta_instruction": "Be terse.", "session_len": 512, "stop_words": ["<|im_end|>", "###"],
         "temperature": 0.3}))
    chosen = load_chat_template(path)
    assert (chosen.name, chosen.source) == ("terse.json", "json")
    t = chosen.template
    assert type(t) is CHAT_TEMPLATES.get("chatml")
    assert (t.session_len, t.stop_words, t.temperature, t.top_p) == (512, ["<|im_end|>", "###"], 0.3, 0.8)
    assert t.get_prompt("hi") == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_json_file_without_model_name_is_a_role_template(tmp_path):
    path = write(tmp_path, "qa.json", json.dumps({"user": "Q: ", "eoh": "\n", "assistant": "A:"}))
    t = load_chat_template(path).template
    assert type(t) is RoleTemplate and t.get_prompt("why?") == "Q: why?\nA:"


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"model_name": "chatml", "colour": "red"}', "unknown field(s) colour"),
    ('{"model_name": "gpt-9"}', "model_name: unknown chat template 'gpt-9'"),
    ('{"session_len": "long"}', "session_len: Input should be a valid integer"),
    ('{"stop_words": "###"}', "stop_words: Input should be a valid list"),
    ('{"top_p": 2}', "top_p must be in (0, 1]"),
    ('{"model_name": "internlm-20b", "user": "U:"}', "unknown field(s) user"),   # a base template has no roles
])
def test_a_bad_json_file(tmp_path, content, message):
    path = write(tmp_path, "bad.json", content)
    with pytest.raises(ChatTemplateConfigError) as e:
        load_chat_template(path)
    assert message in str(e.value) and "bad.json" in str(e.value)


def test_a_jinja_file(tmp_path):
    path = write(tmp_path, "plain.jinja", "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    chosen = load_chat_template(path)
    assert (chosen.name, chosen.source) == ("plain.jinja", "jinja")
    assert isinstance(chosen.template, JinjaTemplate) and chosen.template.session_len is None


def test_a_jinja_syntax_error_is_caught_at_load(tmp_path):
    path = write(tmp_path, "broken.jinja", "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ChatTemplateConfigError, match=r"broken.jinja: the chat template is not valid Jinja \(line 1"):
        load_chat_template(path)


@pytest.mark.parametrize("name", ["missing.jinja", "missing.json"])
def test_a_missing_file(tmp_path, name):
    with pytest.raises(ChatTemplateConfigError, match="cannot read the chat template .*No such file"):
        load_chat_template(str(tmp_path / name))


def test_a_file_that_is_not_text(tmp_path):
    path = tmp_path / "binary.jinja"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ChatTemplateConfigError, match="not UTF-8"):
        load_chat_template(str(path))


# -- without the flag ------------------------------------------------------------------------

def test_the_tokenizers_own_template_comes_first(smollm2_tokenizer, tmp_path):
    # even in a directory whose name matches a registry template
    chosen = choose_chat_template(None, smollm2_tokenizer, str(tmp_path / "Llama-2-7b-chat"))
    assert (chosen.name, chosen.source) == ("tokenizer", "tokenizer")
    assert chosen.template.source == smollm2_tokenizer.chat_template


def test_else_a_template_matched_from_the_model_name(tmp_path):
    chosen = choose_chat_template(None, NoTemplateTokenizer(), str(tmp_path / "Meta-Llama-3-8B-Instruct"))
    assert (chosen.name, chosen.source) == ("llama3", "matched")
    assert choose_chat_template(None, NoTemplateTokenizer(), str(tmp_path / "my-model")) is None


def test_the_flag_wins_over_the_tokenizer(smollm2_tokenizer, tmp_path):
    chosen = choose_chat_template(load_chat_template("vicuna"), smollm2_tokenizer, str(tmp_path))
    assert chosen.name == "vicuna"
    jinja = choose_chat_template(load_chat_template(write(tmp_path, "t.jinja", "{{ messages[0]['content'] }}")),
                                 smollm2_tokenizer, str(tmp_path))
    assert jinja.template.tokenizer is smollm2_tokenizer and jinja.render([{"role": "user", "content": "x"}]) == "x"


@pytest.mark.parametrize("model, expected", [
    ("Llama-2-7b-chat-hf", "llama2"),
    ("llama2-13b-chat.Q4_K_M.gguf", "llama2"),
    ("Llama-2-7b-hf", None),
    ("Meta-Llama-3-8B-Instruct", "llama3"),
    ("Mistral-7B-Instruct-v0.2", "mistral"),
    ("Mistral-7B-v0.1", None),
    ("gemma-2-9b-it", "gemma"),
    ("gemma-3-1b-it-Q4_0.gguf", "gemma"),
    ("gemma-2-9b", None),
    ("Qwen-7B-Chat", "qwen"),
    ("vicuna-7b-v1.5", "vicuna"),
    ("llava-v1.5-7b", "llava"),
    ("internlm-chat-7b-8k", "internlm-chat-7b-8k"),
    ("internlm_chat_20b", "internlm-chat-20b"),
    ("internlm-chat-7b", "internlm-chat-7b"),
    ("internlm-20b", "internlm-20b"),
    ("SmolLM2-135M-Instruct.Q4_1", "smollm"),
    ("gpt2", None),
])
def test_match_chat_template(model, expected):
    assert match_chat_template([model]) == expected


def test_the_config_names_the_model_too(tmp_path):
    model = tmp_path / "checkpoint-1000"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"_name_or_path": "lmsys/vicuna-7b-v1.5", "model_type": "llama"}))
    assert model_name_hints(str(model)) == ["checkpoint-1000", "lmsys/vicuna-7b-v1.5", "llama"]
    assert choose_chat_template(None, NoTemplateTokenizer(), str(model)).name == "vicuna"


# -- stop words ------------------------------------------------------------------------------

def test_stop_words_split_into_token_ids_and_texts(smollm2_tokenizer):
    template = CHAT_TEMPLATES.get("chatml")(stop_words=["<|im_end|>", "User:"])
    stop = ChosenTemplate(template, "chatml", "registry").stop_words(smollm2_tokenizer)
    assert stop == StopWords(texts=("User:",), token_ids=(smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    assert ChosenTemplate(RoleTemplate(), "x", "json").stop_words(smollm2_tokenizer) == StopWords()


def test_file_kinds_go_by_suffix_whatever_its_case(tmp_path):
    path = write(tmp_path, "T.JSON", json.dumps({"model_name": "vicuna"}))
    assert load_chat_template(path).source == "json"
    assert load_chat_template(write(tmp_path, "T.Jinja", "{{ 1 }}")).source == "jinja"


def test_a_builtin_name_wins_over_a_file_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "llama3", "not a template")
    assert load_chat_template("llama3").source == "registry"
    assert load_chat_template("./llama3").source == "jinja"      # a path says it is a file


def test_model_name_must_be_a_name(tmp_path):
    with pytest.raises(ChatTemplateConfigError, match="model_name must be the name of a built-in template"):
        load_chat_template(write(tmp_path, "list.json", '{"model_name": ["chatml"]}'))
