"""The command line: user errors are one line on stderr and exit code 2."""

from __future__ import annotations

import pytest

from llmserve.cli import build_parser, main


def test_missing_model_is_a_one_line_error(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "missing"), "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmserve: error: model path") and "\n" not in err


def test_bad_sampling_flag_is_a_one_line_error(capsys):
    assert main(["generate", "--max-new-tokens", "0", "hello"]) == 2
    assert "max_new_tokens must be a positive integer" in capsys.readouterr().err


def test_generate_with_a_tiny_model(capsys, tiny_llama_dir):
    assert main(["generate", "--model", tiny_llama_dir, "--max-new-tokens", "4", "Hello", "World"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Hello") and any(l.startswith("World") for l in lines)


def test_help_lists_the_commands():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])


def test_templates_lists_the_builtins(capsys):
    assert main(["templates"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("llama2", "llama3", "chatml", "internlm-chat-7b", "vicuna"))


def test_templates_shows_a_rendering(capsys):
    assert main(["templates", "llama2"]) == 0
    assert "'[INST] {user 1} [/INST]'" in capsys.readouterr().out


def test_unknown_chat_template_is_a_one_line_error_before_the_model_loads(capsys, tmp_path):
    # the model path does not exist either: the template is checked first
    assert main(["chat", "--model", str(tmp_path / "missing"), "--chat-template", "nope", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmserve: error: unknown chat template 'nope'") and "\n" not in err


def test_serve_help_explains_generation_config(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--generation-config auto|none|vllm|PATH" in help_text
    assert "generation_config.json" in help_text and "(default: auto)" in help_text


def test_bad_generation_config_is_a_one_line_error_before_the_model_loads(capsys, tmp_path, tiny_llama_dir, monkeypatch):
    import llmserve.server.serve as serve_module

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(serve_module, "EngineCoreProcess", no_model)
    (tmp_path / "generation_config.json").write_text('{"top_p": 7}')
    assert main(["serve", "--model", tiny_llama_dir, "--port", "0", "--generation-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmserve: error: ") and "top_p must be in (0, 1]" in err and "\n" not in err
