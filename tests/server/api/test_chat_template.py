"""Chat templates end to end: ``llmserve serve --chat-template NAME|FILE.json|FILE.jinja``, the
tokenizer's own template and no template at all, through real servers driven by the `openai` SDK.

The prompts each template should produce are written out literally here (never produced by
``llmserve.chat_template``) and checked against what the server used: the prompt token count,
and a greedy chat answer equal to a greedy /v1/completions answer whose prompt is the expected
token ids.

The --chat-template servers and the template-less one serve ``plain-model``: a copy of the tiny
Llama whose tokenizer has no chat template and adds a BOS (``<|endoftext|>``, id 0) when asked
for special tokens, so the tests see who writes the BOS: the tokenizer for registry and JSON
templates (the server encodes with add_special_tokens=True), the template itself for Jinja ones
(add_special_tokens=False). /tokenize always encodes with the tokenizer's special tokens.

Servers: llama3 (registry), a JSON file, a Jinja file, none (plain-model without the flag), and
the shared ``tiny_server`` (the tokenizer's own ChatML template).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from serving_utils import ServerProcess, llmserve_command

MODEL = "tiny"
TIMEOUT = httpx.Timeout(60.0)
BOS, BOS_ID = "<|endoftext|>", 0       # what plain-model's tokenizer puts first with add_special_tokens=True
SESSION_LEN = 64                       # the JSON template's

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]
SHORT = [{"role": "user", "content": "Name a colour."}]     # no system message: the template's default one

# --chat-template llama3 (Llama 3 Instruct's format; its special tokens are plain text in SmolLM2's vocabulary)
LLAMA3_CONV = ("<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nBlue.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nAnother one?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n")

# The JSON template: ChatML with meta_instruction "Be terse." (used when the conversation has no system message)
CHATML_CONV = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
               "<|im_start|>user\nName a colour.<|im_end|>\n"
               "<|im_start|>assistant\nBlue.<|im_end|>\n"
               "<|im_start|>user\nAnother one?<|im_end|>\n"
               "<|im_start|>assistant\n")


def chatml_short(user: str = "Name a colour.") -> str:
    return f"<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


# The Jinja file: its own BOS, one line per message, a raise_exception for tool messages
JINJA_SOURCE = ("{{ bos_token }}{% for m in messages %}"
                "{% if m['role'] == 'tool' %}{{ raise_exception('mini.jinja has no tool role') }}{% endif %}"
                "[{{ m['role'] }}] {{ m['content'] }}{{ '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
JINJA_CONV = "<|endoftext|>[system] You are terse.\n[user] Name a colour.\n[assistant] Blue.\n[user] Another one?\n[assistant]"


# -- model directory and servers ---------------------------------------------------------

@pytest.fixture(scope="module")
def plain_model_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """tiny_llama_dir without a chat template, its tokenizer adding <|endoftext|> as a BOS."""
    path = tmp_path_factory.mktemp("models") / "plain-model"
    shutil.copytree(tiny_llama_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)     # where transformers 5 saves it
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)                          # where older versions save it
    config["bos_token"] = BOS
    config_path.write_text(json.dumps(config))
    tokenizer_path = path / "tokenizer.json"
    spec = json.loads(tokenizer_path.read_text())
    bos, a, b = ({"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}})
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, a], "pair": [bos, a, b],
                              "special_tokens": {BOS: {"id": BOS, "ids": [BOS_ID], "tokens": [BOS]}}}
    tokenizer_path.write_text(json.dumps(spec))

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert not tokenizer.chat_template, "the copy still has a chat template"
    assert tokenizer.bos_token == BOS
    assert tokenizer("Hi").input_ids == [BOS_ID] + tokenizer("Hi", add_special_tokens=False).input_ids != [BOS_ID]
    return str(path)


@pytest.fixture(scope="module")
def plain_tokenizer(plain_model_dir):
    return AutoTokenizer.from_pretrained(plain_model_dir)


@pytest.fixture(scope="module")
def servers(plain_model_dir, tmp_path_factory) -> dict[str, ServerProcess]:
    """The llama3, Jinja and template-less servers, started side by side (each start is seconds of
    CPU, partly spent waiting). The template-less one has no --chat-template, no template in its
    tokenizer, and a name no pattern matches."""
    template = tmp_path_factory.mktemp("jinja") / "mini.jinja"
    template.write_text(JINJA_SOURCE)
    flags = {"registry": ["--chat-template", "llama3"], "jinja": ["--chat-template", str(template)], "bare": []}
    with ThreadPoolExecutor(len(flags)) as pool:
        starting = {name: pool.submit(ServerProcess, plain_model_dir, "--served-model-name", MODEL, *args)
                    for name, args in flags.items()}
        started = {name: future.result() for name, future in starting.items() if future.exception() is None}
        try:
            for future in starting.values():
                future.result()           # the first start that failed, once the others are stopped below
            yield started
        finally:
            list(pool.map(lambda server: server.__exit__(None, None, None), started.values()))


@pytest.fixture(scope="module")
def registry_server(servers):
    return servers["registry"]


@pytest.fixture(scope="module")
def jinja_server(servers):
    return servers["jinja"]


@pytest.fixture(scope="module")
def bare_server(servers):
    return servers["bare"]


@dataclass
class Greedy:
    ids: list[int]          # the expected prompt, BOS included
    text: str               # its greedy continuation (ignore_eos)
    tokens: list[str]
    offsets: list[int]


@dataclass
class JSONCase:
    short: Greedy           # chatml_short(): the meta_instruction conversation, 12 tokens
    conv: Greedy            # CHATML_CONV, as many tokens as session_len leaves
    stop: str               # the multi-token stop word picked from short.text
    fields: dict


@pytest.fixture(scope="module")
def json_case(registry_server, plain_tokenizer) -> JSONCase:
    """The JSON template's stop word must occur in a chat answer, so it is picked before that server
    starts: from greedy /v1/completions runs of the expected prompts' token ids on the registry
    server (same weights; /v1/completions does not involve a chat template)."""
    def greedy(text: str, max_tokens: int) -> Greedy:
        ids = tokenize(registry_server, text)
        c = client(registry_server).completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                       logprobs=0, extra_body={"ignore_eos": True}).choices[0]
        assert len(c.logprobs.tokens) == max_tokens
        return Greedy(ids, c.text, c.logprobs.tokens, c.logprobs.text_offset)

    short = greedy(chatml_short(), 12)
    conv = greedy(CHATML_CONV, SESSION_LEN - len(tokenize(registry_server, CHATML_CONV)))
    # The template's token stop words (<|im_end|> is also the EOS, which ignore_eos does not silence
    # as a stop word; "zz" is one token) must not end these answers early.
    for word in ("<|im_end|>", "zz"):
        assert word not in short.tokens + conv.tokens, f"pick other conversations: the model says {word!r}"

    def pick_stop() -> str:
        # whole tokens 2.. of the short answer, several tokens when encoded alone, first seen there,
        # and absent from the long answer (which must run to session_len)
        for i in range(2, 9):
            for width in (2, 3):
                word = short.text[short.offsets[i]:short.offsets[i + width]]
                if ("\ufffd" not in word and word.strip() and short.text.find(word) == short.offsets[i]
                        and word not in conv.text and len(plain_tokenizer(word, add_special_tokens=False).input_ids) > 1):
                    return word
        raise AssertionError(f"no usable stop word in {short.text!r}")

    stop = pick_stop()
    fields = {"model_name": "chatml", "meta_instruction": "Be terse.", "session_len": SESSION_LEN, "top_k": 1,
              "stop_words": ["<|im_end|>", "zz", stop]}
    return JSONCase(short, conv, stop, fields)


@pytest.fixture(scope="module")
def json_server(plain_model_dir, json_case, tmp_path_factory):
    template = tmp_path_factory.mktemp("json") / "terse-chatml.json"
    template.write_text(json.dumps(json_case.fields))
    with ServerProcess(plain_model_dir, "--served-model-name", MODEL, "--chat-template", str(template)) as server:
        yield server


# -- helpers -----------------------------------------------------------------------------

def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai_client()


def tokenize(server: ServerProcess, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"inputs": text}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()]


def greedy_chat(server: ServerProcess, messages, max_tokens: int | None, **kw):
    return client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                                  extra_body={"ignore_eos": True}, **kw)


def greedy_completion(server: ServerProcess, ids: list[int], max_tokens: int) -> str:
    r = client(server).completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens
    return r.choices[0].text


def post_chat(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL} | body, timeout=TIMEOUT)


def assert_template_error(r: httpx.Response, *words: str, param: str = "messages") -> str:
    """OpenAI's error body with status 422; returns the message."""
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", 422, param), error
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


def assert_chat_works(server: ServerProcess, messages=SHORT) -> None:
    r = post_chat(server, {"messages": messages, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def chat_template_info(server: ServerProcess):
    info = httpx.get(server.url + "/info", timeout=TIMEOUT).json()["chat_template"]
    [model] = client(server).models.list().data
    return info, model.model_extra["chat_template"]


# -- start-up errors ---------------------------------------------------------------------

STARTUP_ERRORS = {
    # name: (--chat-template file name or value, file text or None, words stderr must have)
    "unknown_name": ("no-such-template", None, ["no-such-template", "llama3", "chatml", "vicuna"]),
    "json_syntax": ("broken.json", '{"model_name": "chatml", "session_len": 64,', ["broken.json", "not valid JSON"]),
    "json_unknown_field": ("typo.json", '{"model_name": "chatml", "sesion_len": 64}',
                           ["typo.json", "unknown field", "sesion_len"]),
    "json_bad_type": ("badtype.json", '{"model_name": "chatml", "session_len": "long"}', ["badtype.json", "session_len"]),
    "json_bad_value": ("badvalue.json", '{"model_name": "llama3", "top_p": 2}', ["badvalue.json", "top_p"]),
    "json_unknown_model_name": ("base.json", '{"model_name": "no-such-base"}', ["base.json", "no-such-base", "chatml"]),
    "jinja_syntax": ("broken.jinja", "{% for m in messages %}{{ m['content'] }}", ["broken.jinja", "not valid Jinja"]),
    # the template is checked before the model is loaded: with no model at all, the error is the template's
    "unknown_name_before_model_load": ("no-such-template", None, ["no-such-template", "llama3"]),
    "json_non_string_model_name": ("listname.json", '{"model_name": ["chatml"]}', ["listname.json", "model_name"]),
}


@pytest.fixture(scope="module")
def startup_failures(tiny_llama_dir, tmp_path_factory) -> dict[str, tuple[int, str, float]]:
    """Every STARTUP_ERRORS case (each a process start), a few side by side: name -> (exit code, stderr, seconds)."""
    tmp = tmp_path_factory.mktemp("startup-errors")

    def run(name: str) -> tuple[int, str, float]:
        spec, text, _ = STARTUP_ERRORS[name]
        if text is not None:
            (tmp / spec).write_text(text)
            spec = str(tmp / spec)
        model = str(tmp / "no-model-here") if name.endswith("before_model_load") else tiny_llama_dir
        started = time.monotonic()
        proc = subprocess.run([*llmserve_command(), "serve", "--model", model, "--port", "0", "--chat-template", spec],
                              capture_output=True, text=True, timeout=60, cwd=tmp)
        return proc.returncode, proc.stderr, time.monotonic() - started

    # a few at a time: side by side they share the CPUs, one by one they take long
    with ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 1))) as pool:
        return dict(zip(STARTUP_ERRORS, pool.map(run, STARTUP_ERRORS)))


@pytest.mark.parametrize("case", list(STARTUP_ERRORS))
def test_bad_chat_template_fails_at_startup(startup_failures, case):
    returncode, stderr, seconds = startup_failures[case]
    assert returncode == 2, stderr
    assert "Traceback" not in stderr and "llmserve: error:" in stderr, stderr
    for word in STARTUP_ERRORS[case][2]:
        assert word in stderr, stderr
    assert "model path" not in stderr and "# llama" not in stderr, stderr    # not the model's error, nor loaded
    assert seconds < 30, f"took {seconds:.0f} s to fail"


# -- registry: --chat-template llama3 -----------------------------------------------------

def test_registry_template_renders_the_conversation(registry_server, plain_tokenizer):
    ids = tokenize(registry_server, LLAMA3_CONV)
    # the text has no BOS of its own: the tokenizer's is the one in front, once
    assert ids == [BOS_ID] + plain_tokenizer(LLAMA3_CONV, add_special_tokens=False).input_ids
    r = greedy_chat(registry_server, CONV, max_tokens=8)
    assert r.usage.prompt_tokens == len(ids)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (8, "length")
    assert r.choices[0].message.content == greedy_completion(registry_server, ids, 8)


def test_registry_template_sampling_defaults(registry_server):
    """llama3's temperature 0.6 and top_p 0.9 apply when a request leaves them unset."""
    def sample(**kw) -> str:
        r = client(registry_server).chat.completions.create(model=MODEL, messages=SHORT, max_tokens=12, seed=1234,
                                                            extra_body={"ignore_eos": True}, **kw)
        assert r.usage.completion_tokens == 12
        return r.choices[0].message.content

    unset = sample()
    assert unset == sample(temperature=0.6, top_p=0.9)
    assert unset != sample(temperature=1.0, top_p=1.0)


def test_registry_template_role_errors(registry_server):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client(registry_server).chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "Hi"}],
                                                        max_tokens=2)
    assert e.value.status_code == 422 and "wizard" in e.value.message
    assert_template_error(post_chat(registry_server, {"messages": [{"role": "wizard", "content": "Hi"}]}), "wizard")
    assert_chat_works(registry_server)
    # a tool result must answer a call of an earlier assistant message (llama3 renders them: test_tools.py)
    tool_turn = [*SHORT, {"role": "assistant", "content": "Blue."}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    r = post_chat(registry_server, {"messages": tool_turn, "max_tokens": 2})
    assert r.status_code == 400 and "answers no tool call" in r.json()["error"]["message"], r.text
    assert_chat_works(registry_server)
    # "developer" is OpenAI's newer name for "system"
    developer = [{"role": "developer", "content": "You are terse."}, *CONV[1:]]
    assert greedy_chat(registry_server, developer, max_tokens=1).usage.prompt_tokens == len(tokenize(registry_server, LLAMA3_CONV))


def test_registry_template_is_reported(registry_server):
    info, listed = chat_template_info(registry_server)
    assert info == {"name": "llama3", "source": "registry", "session_len": 8192, "stop_words": ["<|eot_id|>"]}
    assert listed == "llama3"


# -- JSON: a ChatML variant with its own system text, session_len, top_k and stop words -----

def test_json_template_renders_the_conversation(json_server, json_case, plain_tokenizer):
    for text, greedy in ((CHATML_CONV, json_case.conv), (chatml_short(), json_case.short)):
        assert tokenize(json_server, text) == greedy.ids == [BOS_ID] + plain_tokenizer(text, add_special_tokens=False).input_ids
    conv = json_case.conv
    r = greedy_chat(json_server, CONV, max_tokens=6)      # the conversation's system message, not meta_instruction
    assert r.usage.prompt_tokens == len(conv.ids)
    assert r.choices[0].message.content == greedy_completion(json_server, conv.ids, 6) == conv.text[:conv.offsets[6]]


def test_json_template_stop_word_is_a_stop_string(json_server, json_case):
    """A multi-token stop word ends the answer like a request's stop string: cut before it."""
    short, stop = json_case.short, json_case.stop
    expected = short.text[:short.text.index(stop)]
    r = greedy_chat(json_server, SHORT, max_tokens=12)
    assert r.usage.prompt_tokens == len(short.ids)      # the meta_instruction stands in for the system message
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (expected, "stop")
    assert stop not in r.choices[0].message.content and r.usage.completion_tokens < 12
    chunks = list(client(json_server).chat.completions.create(
        model=MODEL, messages=SHORT, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # /v1/completions is no chat: the template's stop words do not apply there
    assert greedy_completion(json_server, short.ids, 12) == short.text


def test_json_template_sampling_default_top_k(json_server, json_case):
    """The file's top_k=1 applies when a request leaves top_k unset: sampling at temperature 1 is greedy."""
    short = json_case.short
    greedy = short.text[:short.text.index(json_case.stop)]

    def sample(**extra) -> str:
        return client(json_server).chat.completions.create(model=MODEL, messages=SHORT, max_tokens=12, temperature=1.0,
                                                           seed=5, extra_body={"ignore_eos": True} | extra
                                                           ).choices[0].message.content
    assert sample() == greedy
    assert sample(top_k=0) != greedy        # a request's own top_k (0: no limit) wins


def test_json_template_session_len(json_server, json_case):
    conv, short = json_case.conv, json_case.short
    # an unset max_tokens is what session_len leaves
    r = greedy_chat(json_server, CONV, max_tokens=None)
    assert r.usage.prompt_tokens + r.usage.completion_tokens == SESSION_LEN
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (conv.text, "length")
    # an explicit one may fill it, not more
    room = SESSION_LEN - len(short.ids)
    assert greedy_chat(json_server, SHORT, max_tokens=room).choices[0].finish_reason == "stop"   # the stop word, early
    message = assert_template_error(post_chat(json_server, {"messages": SHORT, "max_tokens": room + 1}),
                                    "session_len", str(SESSION_LEN), param="max_tokens")
    assert str(room + 1) in message
    assert_template_error(post_chat(json_server, {"messages": SHORT, "max_completion_tokens": room + 1}),
                          "session_len", param="max_completion_tokens")
    assert_chat_works(json_server)

    # a conversation of session_len - 1 tokens gets one token; one of session_len tokens is refused
    words = SESSION_LEN          # each " x" is one token: count down to a conversation of session_len tokens
    while len(tokenize(json_server, chatml_short(" ".join(["x"] * words)))) > SESSION_LEN:
        words -= 1
    user = " ".join(["x"] * words)
    assert len(tokenize(json_server, chatml_short(user))) == SESSION_LEN
    assert_template_error(post_chat(json_server, {"messages": [{"role": "user", "content": user}]}),
                          "session_len", f"is {SESSION_LEN} tokens")
    shorter = " ".join(["x"] * (words - 1))
    r = greedy_chat(json_server, [{"role": "user", "content": shorter}], max_tokens=None)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (SESSION_LEN - 1, 1)
    # far over
    assert_template_error(post_chat(json_server, {"messages": [{"role": "user", "content": "x " * 200}]}), "session_len")
    assert_chat_works(json_server)


def test_json_template_is_reported(json_server, json_case):
    info, listed = chat_template_info(json_server)
    assert info == {"name": "terse-chatml.json", "source": "json", "session_len": SESSION_LEN,
                    "stop_words": ["<|im_end|>", "zz", json_case.stop]}
    assert listed == "terse-chatml.json"


# -- Jinja file --------------------------------------------------------------------------

def test_jinja_template_renders_the_conversation(jinja_server, plain_tokenizer):
    expected = plain_tokenizer(JINJA_CONV, add_special_tokens=False).input_ids
    assert expected[0] == BOS_ID != expected[1]          # the template's BOS, once
    # /tokenize adds the tokenizer's BOS in front of the template's; the chat prompt must not
    assert tokenize(jinja_server, JINJA_CONV) == [BOS_ID] + expected
    r = greedy_chat(jinja_server, CONV, max_tokens=8)
    assert r.usage.prompt_tokens == len(expected)
    assert r.choices[0].message.content == greedy_completion(jinja_server, expected, 8)


def test_jinja_template_brings_no_sampling_defaults(jinja_server):
    def sample(**kw) -> str:
        return client(jinja_server).chat.completions.create(model=MODEL, messages=SHORT, max_tokens=12, seed=1234,
                                                            extra_body={"ignore_eos": True}, **kw).choices[0].message.content
    unset = sample()
    assert unset == sample(temperature=1.0, top_p=1.0)      # OpenAI's defaults
    assert unset != sample(temperature=0.6, top_p=0.9)


def test_jinja_template_errors(jinja_server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool_turn = [*SHORT, {"role": "assistant", "content": "Blue.", "tool_calls": [call]},
                 {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert_template_error(post_chat(jinja_server, {"messages": tool_turn, "max_tokens": 2}), "mini.jinja has no tool role")
    assert_chat_works(jinja_server)
    assert_template_error(post_chat(jinja_server, {"messages": [{"role": "wizard", "content": "Hi"}]}), "wizard")
    assert_chat_works(jinja_server)


def test_jinja_template_is_reported(jinja_server):
    info, listed = chat_template_info(jinja_server)
    assert info == {"name": "mini.jinja", "source": "jinja", "session_len": None, "stop_words": None}
    assert listed == "mini.jinja"


# -- the tokenizer's own template (no flag) ------------------------------------------------

def test_tokenizer_template(tiny_server):
    info, listed = chat_template_info(tiny_server)
    assert info == {"name": "tokenizer", "source": "tokenizer", "session_len": None, "stop_words": None}
    assert listed == "tokenizer"
    assert_template_error(post_chat(tiny_server, {"messages": [{"role": "wizard", "content": "Hi"}]}), "wizard")
    assert_chat_works(tiny_server)


# -- no template at all ------------------------------------------------------------------

def test_no_chat_template(bare_server):
    info, listed = chat_template_info(bare_server)
    assert info is None and listed is None
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client(bare_server).chat.completions.create(model=MODEL, messages=SHORT, max_tokens=2)
    assert "has no chat template" in e.value.message and "--chat-template" in e.value.message
    assert_template_error(post_chat(bare_server, {"messages": SHORT, "max_tokens": 2}), "has no chat template")
    # the server still serves what needs no template
    r = client(bare_server).completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
