"""Bad models are one-line errors, raised before or while the workers start."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from llmserve import LLM
from llmserve.common.basemodel.layer_weights.hf_load_utils import ModelLoadError


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        LLM(str(tmp_path / "nope"))
    assert "does not exist" in one_line(e)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError) as e:
        LLM(str(tmp_path))
    assert "unsupported architecture 'gpt2'" in one_line(e)


def test_heads_not_divisible_by_tp(tiny_llama_dir):
    with pytest.raises(ValueError) as e:
        LLM(tiny_llama_dir, tp=3)
    assert "not divisible by tp=3" in one_line(e)


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: os.path.getsize(weights) // 2])
    with pytest.raises(ModelLoadError) as e:
        LLM(str(broken))
    assert "model.safetensors" in one_line(e)
