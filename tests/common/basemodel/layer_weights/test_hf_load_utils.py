"""hf_load_utils on tiny checkpoints written by transformers itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmserve.common.basemodel.layer_weights.hf_load_utils import (
    ModelLoadError,
    iter_hf_weight_files,
    list_hf_weight_files,
    load_hf_config,
)


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def merged(model_dir: Path) -> tuple[dict[str, torch.Tensor], int]:
    """All tensors of a directory and how many per-file dicts they came in."""
    out: dict[str, torch.Tensor] = {}
    n_files = 0
    for weights in iter_hf_weight_files(str(model_dir), progress=False):
        assert out.keys().isdisjoint(weights)
        out.update(weights)
        n_files += 1
    return out, n_files


def assert_same_weights(loaded: dict[str, torch.Tensor], model: LlamaForCausalLM) -> None:
    expected = model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_single_safetensors_file(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    tiny_model.save_pretrained(tmp_path)
    config = load_hf_config(str(tmp_path))
    assert config["model_type"] == "llama" and config["hidden_size"] == 32 and config["num_key_value_heads"] == 2
    loaded, n_files = merged(tmp_path)
    assert n_files == 1
    assert_same_weights(loaded, tiny_model)


def test_sharded_safetensors_with_index(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    tiny_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    # A stray file the index does not name must not be loaded.
    (tmp_path / "extra.safetensors").write_bytes(b"not weights")
    loaded, n_files = merged(tmp_path)
    assert n_files > 1
    assert_same_weights(loaded, tiny_model)


def test_pytorch_bin_files(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    # transformers 5 always writes safetensors (no safe_serialization=False), so write .bin shards
    # the way older transformers did: torch.save of state-dict pieces.
    state = tiny_model.state_dict()
    names = sorted(state)
    half = len(names) // 2
    torch.save({k: state[k] for k in names[:half]}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({k: state[k] for k in names[half:]}, tmp_path / "pytorch_model-00002-of-00002.bin")
    loaded, n_files = merged(tmp_path)
    assert n_files == 2
    assert_same_weights(loaded, tiny_model)


def test_missing_or_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_config(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        iter_hf_weight_files(str(tmp_path / "nope"))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_hf_config(str(a_file))


def test_bad_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        load_hf_config(str(tmp_path))


def test_no_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"no weights found in .*looked for \*\.safetensors, pytorch_model\*\.bin"):
        iter_hf_weight_files(str(tmp_path))


def test_truncated_safetensors(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    tiny_model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is corrupt or truncated"):
        merged(tmp_path)


def test_corrupt_bin(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"garbage, neither a zip file nor a pickle")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin is corrupt"):
        merged(tmp_path)


def test_index_naming_a_missing_shard(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    tiny_model.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = list_hf_weight_files(str(tmp_path))
    Path(shards[-1]).unlink()
    with pytest.raises(ModelLoadError, match=f"names missing file.*{Path(shards[-1]).name}"):
        iter_hf_weight_files(str(tmp_path))


def test_index_without_weight_map(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ModelLoadError, match="no 'weight_map'"):
        iter_hf_weight_files(str(tmp_path))


@pytest.mark.parametrize("tty", [False, True])
def test_the_progress_bar_is_drawn_only_on_a_terminal(tmp_path: Path, tiny_model: LlamaForCausalLM, tty: bool,
                                                      monkeypatch) -> None:
    """A log file must not fill with a progress bar's carriage returns."""
    import io
    import sys

    class Stderr(io.StringIO):
        def isatty(self) -> bool:
            return tty

    tiny_model.save_pretrained(tmp_path)
    monkeypatch.setattr(sys, "stderr", Stderr())
    list(iter_hf_weight_files(str(tmp_path), progress=True))
    assert ("Loading weights" in sys.stderr.getvalue()) == tty
