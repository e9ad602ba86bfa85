"""The command line: user errors are one line on stderr and exit code 2."""

from __future__ import annotations

import pytest

from llmserve.cli import build_parser, main, parse_args


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


# -- vLLM's and TGI's flag names, the environment, --version ----------------------------------

ALIASES = [   # (their flag, its value, our dest, what we store)
    (["--model-id", "/m"], "model", "/m"),                       # TGI
    (["--tensor-parallel-size", "2"], "tp", 2),                  # vLLM
    (["-tp", "2"], "tp", 2),                                     # vLLM's short form
    (["--num-shard", "2"], "tp", 2),                             # TGI
    (["--pipeline-parallel-size", "2"], "pp", 2),                # vLLM
    (["-pp", "2"], "pp", 2),                                     # vLLM's short form
    (["--pp-size", "2"], "pp", 2),                               # SGLang
    (["--data-parallel-size", "2"], "dp", 2),                    # vLLM
    (["-dp", "2"], "dp", 2),                                     # vLLM's short form
    (["--dp-size", "2"], "dp", 2),                               # SGLang
    (["--hostname", "0.0.0.0"], "host", "0.0.0.0"),              # TGI
    (["--max-model-len", "4096"], "max_total_tokens", 4096),     # vLLM
    (["--max-input-length", "1000"], "max_input_tokens", 1000),  # TGI (older name)
    (["--gpu-memory-utilization", "0.5"], "mem_fraction", 0.5),  # vLLM
    (["--cuda-memory-fraction", "0.5"], "mem_fraction", 0.5),    # TGI
    (["--max-num-seqs", "7"], "max_running_requests", 7),        # vLLM
    (["--max-batch-size", "7"], "max_running_requests", 7),      # TGI
    (["--max-num-batched-tokens", "512"], "max_batch_prefill_tokens", 512),   # vLLM
    (["--max-batch-total-tokens", "9000"], "max_total_token_num", 9000),      # TGI
    (["--no-enable-chunked-prefill"], "chunked_prefill", False),              # vLLM
    (["--no-enable-prefix-caching"], "prefix_cache", False),                  # vLLM
    (["--dtype", "half"], "dtype", "float16"),                   # vLLM's value names
    (["--dtype", "float"], "dtype", "float32"),
    (["/models/llama"], "model", "/models/llama"),               # `vllm serve MODEL`
    (["--json-output"], "log_format", "json"),                   # TGI
    (["--disable-log-stats"], "log_stats_interval", 0.0),        # vLLM
]


@pytest.mark.parametrize("argv, dest, expected", ALIASES, ids=[" ".join(a[0]) for a in ALIASES])
def test_vllm_and_tgi_flag_names_set_our_flags(argv, dest, expected, monkeypatch):
    _clear_llmserve_env(monkeypatch)
    default = getattr(parse_args(["serve"]), dest)
    assert default != expected
    assert getattr(parse_args(["serve", *argv]), dest) == expected


def test_dtype_auto_leaves_the_choice_to_llmserve(monkeypatch):
    _clear_llmserve_env(monkeypatch)
    monkeypatch.setenv("LLMSERVE_DTYPE", "half")
    assert parse_args(["serve"]).dtype == "float16"
    assert parse_args(["serve", "--dtype", "auto"]).dtype is None


def test_the_positional_model_wins_over_model(monkeypatch):
    _clear_llmserve_env(monkeypatch)
    assert parse_args(["serve", "--model", "/a", "/b"]).model == "/b"


ENV_FORMS = [   # (variable, value, dest, parsed): one per kind of flag
    ("LLMSERVE_MODEL", "/models/x", "model", "/models/x"),               # a string
    ("LLMSERVE_TP", "2", "tp", 2),                                       # an int
    ("LLMSERVE_MEM_FRACTION", "0.5", "mem_fraction", 0.5),               # a float
    ("LLMSERVE_DTYPE", "bfloat16", "dtype", "bfloat16"),                 # a typed choice
    ("LLMSERVE_LOG_LEVEL", "info", "log_level", "info"),                 # a choice
    ("LLMSERVE_ENFORCE_EAGER", "true", "enforce_eager", True),           # a switch
    ("LLMSERVE_ENFORCE_EAGER", "0", "enforce_eager", False),
    ("LLMSERVE_CHUNKED_PREFILL", "off", "chunked_prefill", False),       # a --[no-]switch
    ("LLMSERVE_API_KEY", "secret", "api_key", "secret"),
    ("LLMSERVE_MAX_TOP_N_TOKENS", "7", "max_top_n_tokens", 7),
    ("LLMSERVE_LOG_FORMAT", "json", "log_format", "json"),
    ("LLMSERVE_LOG_STATS_INTERVAL", "0.5", "log_stats_interval", 0.5),
]


@pytest.mark.parametrize("var, value, dest, expected", ENV_FORMS, ids=[f"{v}={x}" for v, x, _, _ in ENV_FORMS])
def test_every_flag_comes_from_its_environment_variable(var, value, dest, expected, monkeypatch):
    _clear_llmserve_env(monkeypatch)
    monkeypatch.setenv(var, value)
    assert getattr(parse_args(["serve"]), dest) == expected


def test_the_command_line_wins_over_the_environment(monkeypatch):
    _clear_llmserve_env(monkeypatch)
    monkeypatch.setenv("LLMSERVE_TP", "2")
    monkeypatch.setenv("LLMSERVE_MODEL", "/env")
    args = parse_args(["serve", "--num-shard", "3", "/cli"])
    assert (args.tp, args.model) == (3, "/cli")


def test_each_flag_has_one_variable_named_after_its_own_name():
    from llmserve.cli import _subparsers, env_var

    actions = {a.option_strings[0]: a for a in _subparsers(build_parser())["serve"]._actions if a.option_strings}
    assert env_var(actions["--max-total-tokens"]) == "LLMSERVE_MAX_TOTAL_TOKENS"
    assert env_var(actions["--chunked-prefill"]) == "LLMSERVE_CHUNKED_PREFILL"
    assert env_var(actions["-h"]) is None
    # TGI's --json-output and vLLM's --disable-log-stats set another flag's value: no variable of their own
    assert env_var(actions["--json-output"]) is None and env_var(actions["--disable-log-stats"]) is None
    canonical = [a for a in actions.values() if env_var(a)]
    assert len(canonical) == len({a.dest for a in canonical}) >= 20    # one variable per setting


@pytest.mark.parametrize("var, value", [("LLMSERVE_TP", "two"), ("LLMSERVE_ENFORCE_EAGER", "maybe"),
                                        ("LLMSERVE_LOG_LEVEL", "loud"), ("LLMSERVE_DTYPE", "int4")])
def test_a_bad_environment_value_is_an_error_naming_the_variable(var, value, monkeypatch, capsys):
    _clear_llmserve_env(monkeypatch)
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve"])
    assert exit_info.value.code == 2
    assert f"error: environment variable {var}={value!r}" in capsys.readouterr().err


def test_version(capsys):
    from llmserve import __version__

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"llmserve {__version__}"


def test_python_dash_m_llmserve():
    import subprocess
    import sys

    top = subprocess.run([sys.executable, "-m", "llmserve", "--help"], capture_output=True, text=True, check=True).stdout
    assert top.startswith("usage: llmserve") and "serve" in top and "--version" in top
    out = subprocess.run([sys.executable, "-m", "llmserve", "serve", "--help"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("usage: llmserve serve") and "--tensor-parallel-size" in out and "--model-id" in out
    assert "[env: LLMSERVE_TP]" in out and "[env: LLMSERVE_LOG_FORMAT]" in " ".join(out.split())


def _clear_llmserve_env(monkeypatch) -> None:
    import os

    for var in [v for v in os.environ if v.startswith("LLMSERVE_")]:
        monkeypatch.delenv(var)


def test_dp_runs_on_one_machine(tiny_llama_dir, capsys, monkeypatch):
    """--dp with --nnodes is refused in a line, before anything starts."""
    _clear_llmserve_env(monkeypatch)
    argv = ["serve", "--model", tiny_llama_dir, "--port", "0", "--dp", "2", "--tp", "2", "--nnodes", "2",
            "--dist-init-addr", "127.0.0.1:1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmserve: error: dp > 1 runs its replicas on one machine") and "\n" not in err


def test_what_pipeline_stages_cannot_run_is_refused_in_a_line(tiny_llama_dir, capsys, monkeypatch):
    """--pp with a feature the stages do not support yet is refused before anything starts, on a
    headless node too."""
    _clear_llmserve_env(monkeypatch)
    for extra in ([], ["--nnodes", "2", "--node-rank", "1", "--headless", "--dist-init-addr", "127.0.0.1:1"]):
        assert main(["serve", "--model", tiny_llama_dir, "--port", "0", "--tp", "2", "--pp", "2",
                     "--enable-custom-all-reduce", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "llmserve: error: the custom all-reduce (--enable-custom-all-reduce) is not supported with pp > 1 yet"
