"""--generation-config: the model's recommended sampling defaults (issue 9, item 10).

The loader is tested directly (fast); one real server shows them in /info, and the command
line shows that a bad --generation-config is a one-line start-up error before the model loads.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest
from transformers import GenerationConfig

from llmserve.generation_config import (
    GENERATION_CONFIG_FILE, SAMPLING_FIELDS, GenerationConfigError, SamplingDefaults, load_sampling_defaults,
)
from llmserve.sampling_params import SamplingParams
from serving_utils import free_port, llmserve_command


def write_config(folder, **fields) -> str:
    """A generation_config.json as HF writes one: token ids beside whatever sampling is given."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    with open(path, "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "transformers_version": "4.42.3", **fields}, f)
    return path


def write_raw(folder, text: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    with open(path, "w") as f:
        f.write(text)
    return path


# -- auto -----------------------------------------------------------------------------


def test_auto_takes_only_the_sampling_fields_the_file_sets(tmp_path):
    path = write_config(tmp_path, do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=256, min_p=0.05)
    defaults = load_sampling_defaults("auto", str(tmp_path))
    # max_new_tokens and min_p are not SamplingParams fields; token ids are not sampling
    assert defaults.values() == {"temperature": 0.6, "top_p": 0.9}
    assert defaults.top_k is None and defaults.repetition_penalty is None and defaults.typical_p is None
    assert defaults.source == path


def test_auto_agrees_with_transformers_on_a_file_it_wrote(tmp_path):
    GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, typical_p=0.95,
                     repetition_penalty=1.05, bos_token_id=1).save_pretrained(tmp_path)
    ours = load_sampling_defaults("auto", str(tmp_path))
    hf = GenerationConfig.from_pretrained(tmp_path)
    assert ours.values() == {name: getattr(hf, name) for name in SAMPLING_FIELDS}


def test_a_value_equal_to_a_class_default_still_counts(tmp_path):
    # read as the file's own JSON: an explicit top_k 50 (once transformers' class default) is
    # the authors' choice, and an unset one is no choice at all
    write_config(tmp_path, temperature=1.0, top_k=50)
    assert load_sampling_defaults("auto", str(tmp_path)).values() == {"temperature": 1.0, "top_k": 50}
    write_config(tmp_path)
    assert load_sampling_defaults("auto", str(tmp_path)).values() == {}


def test_auto_without_a_file_sets_nothing(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    defaults = load_sampling_defaults("auto", str(tmp_path))
    assert defaults.values() == {}
    assert defaults.source.startswith("none")


def test_do_sample_false_keeps_the_sampling_values_as_vllm_does(tmp_path):
    # HF generate() would decode greedily and warn; vLLM (and we) take the values as defaults
    write_config(tmp_path, do_sample=False, temperature=0.3, top_p=0.5)
    assert load_sampling_defaults("auto", str(tmp_path)).values() == {"temperature": 0.3, "top_p": 0.5}
    write_config(tmp_path, do_sample=False)
    assert load_sampling_defaults("auto", str(tmp_path)).values() == {}


def test_null_fields_are_unset(tmp_path):
    write_config(tmp_path, temperature=None, top_p=0.9)
    assert load_sampling_defaults("auto", str(tmp_path)).values() == {"top_p": 0.9}


# -- GGUF files -----------------------------------------------------------------------


def test_the_embedded_model_takes_its_model_card_values(default_model_path):
    defaults = load_sampling_defaults("auto", default_model_path)
    assert defaults.values() == {"temperature": 0.2, "top_p": 0.9}
    assert "model card" in defaults.source


def test_another_gguf_file_gets_no_known_values(tmp_path, default_model_path):
    # the table is keyed by the embedded model, not by a file name that happens to match
    copy = tmp_path / os.path.basename(default_model_path)
    copy.write_bytes(b"GGUF")
    assert load_sampling_defaults("auto", str(copy)).values() == {}


def test_a_generation_config_beside_a_gguf_file_wins(tmp_path):
    gguf = tmp_path / "model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    path = write_config(tmp_path, temperature=0.5)
    defaults = load_sampling_defaults("auto", str(gguf))
    assert defaults.values() == {"temperature": 0.5} and defaults.source == path


# -- none / vllm / a folder -------------------------------------------------------------


@pytest.mark.parametrize("spec", ["none", "vllm"])
def test_none_sets_nothing_even_beside_a_file(tmp_path, spec):
    write_config(tmp_path, temperature=0.6, top_p=0.9)
    defaults = load_sampling_defaults(spec, str(tmp_path))
    assert defaults.values() == {} and defaults.source == spec


def test_a_folder_path_replaces_the_models_file(tmp_path):
    write_config(tmp_path / "model", temperature=0.6)
    path = write_config(tmp_path / "mine", top_k=40, repetition_penalty=1.1)
    defaults = load_sampling_defaults(str(tmp_path / "mine"), str(tmp_path / "model"))
    assert defaults.values() == {"top_k": 40, "repetition_penalty": 1.1} and defaults.source == path
    # the file itself names the same thing
    assert load_sampling_defaults(path, str(tmp_path / "model")) == defaults


# -- bad files and values: start-up errors ---------------------------------------------


@pytest.mark.parametrize("spec", ["missing", "empty-folder", ""])
def test_a_folder_without_the_file_is_an_error(tmp_path, spec):
    (tmp_path / "empty-folder").mkdir()
    spec = str(tmp_path / spec) if spec else spec
    with pytest.raises(GenerationConfigError, match="--generation-config"):
        load_sampling_defaults(spec, str(tmp_path))


@pytest.mark.parametrize("text, reason", [
    ("{not json", "cannot read"),
    ("[0.7]", "must hold a JSON object"),
    ('{"temperature": NaN}', "temperature must be a finite number"),
    ('{"temperature": Infinity}', "temperature must be a finite number"),
    ('{"temperature": 1e999}', "temperature must be a finite number"),
    ('{"temperature": "hot"}', "temperature must be a finite number"),
    ('{"temperature": -0.5}', "temperature must be >= 0"),
    ('{"top_p": 0}', r"top_p must be in \(0, 1\]"),
    ('{"top_p": 1.5}', r"top_p must be in \(0, 1\]"),
    ('{"typical_p": 2}', r"typical_p must be in \(0, 1\]"),
    ('{"top_k": -3}', "top_k must be an integer"),
    ('{"top_k": 2.5}', "top_k must be an integer"),
    ('{"top_k": true}', "top_k must be an integer"),
    ('{"top_k": 9223372036854775808}', "top_k must be an integer"),
    ('{"repetition_penalty": 0}', r"repetition_penalty must be in \[0.01, 100\]"),
    ('{"repetition_penalty": 1e300}', r"repetition_penalty must be in \[0.01, 100\]"),
])
@pytest.mark.parametrize("spec", ["auto", "folder"])
def test_a_bad_file_is_a_one_line_error_naming_it(tmp_path, text, reason, spec):
    path = write_raw(tmp_path, text)
    with pytest.raises(GenerationConfigError, match=reason) as e:
        load_sampling_defaults("auto" if spec == "auto" else str(tmp_path), str(tmp_path))
    assert path in str(e.value) and "\n" not in str(e.value)


def test_the_defaults_fill_only_what_is_unset():
    defaults = SamplingDefaults(temperature=0.2, top_p=0.9, source="test")
    assert defaults.get("temperature", 1.0) == 0.2 and defaults.get("top_k", 0) == 0
    assert defaults.describe() == {"temperature": 0.2, "top_p": 0.9, "top_k": None, "typical_p": None,
                                   "repetition_penalty": None, "source": "test"}
    with pytest.raises(ValueError, match="top_p"):
        SamplingDefaults(top_p=math.nan)


# -- LLM, the command line and the server ------------------------------------------------


@pytest.fixture
def tiny_dir_with_config(tmp_path, tiny_llama_dir):
    """The tiny Llama with a generation_config.json that sets sampling fields (greedy, so that
    its effect shows in the tokens)."""
    folder = tmp_path / "tiny-with-config"
    shutil.copytree(tiny_llama_dir, folder)
    with open(folder / GENERATION_CONFIG_FILE) as f:
        saved = json.load(f)       # the token ids save_pretrained wrote stay
    write_config(folder, **saved, temperature=0.0, top_k=7, repetition_penalty=1.3)
    return str(folder)


def test_llm_uses_the_defaults_where_no_params_are_given(tiny_dir_with_config):
    from llmserve.llm import LLM

    with LLM(tiny_dir_with_config, dtype="float32", max_total_token_num=256) as llm:
        params = llm.default_sampling_params()
        assert (params.temperature, params.top_k, params.repetition_penalty, params.top_p) == (0.0, 7, 1.3, 1.0)
        (by_default,) = llm.generate(["Once upon a time"])
        (explicit,) = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, top_k=7, repetition_penalty=1.3))
        assert by_default.token_ids == explicit.token_ids


def test_llm_with_a_bad_generation_config_fails_before_the_model_loads(tmp_path):
    from llmserve.llm import LLM

    write_raw(tmp_path, '{"top_p": 7}')
    with pytest.raises(GenerationConfigError, match="top_p"):
        LLM(str(tmp_path), generation_config="auto")    # no config.json: the model would fail later


def test_serve_refuses_a_bad_generation_config_before_the_model_loads(tmp_path, tiny_llama_dir):
    cmd = [*llmserve_command(), "serve", "--model", tiny_llama_dir, "--port", str(free_port()),
           "--generation-config", str(tmp_path / "nowhere")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    err = done.stderr.strip()
    assert err.startswith("llmserve: error: --generation-config") and "\n" not in err
    assert "llmserve: serving" not in done.stdout + done.stderr


# /info, the start-up line and the APIs' use of the defaults: tests/server/api/test_sampling_defaults.py
