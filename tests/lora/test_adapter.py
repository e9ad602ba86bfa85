"""Reading PEFT adapter directories: what is served (scaling, rsLoRA, ranks, targets, Phi-3's
fused qkv_proj / gate_up_proj split into their parts, a LLaVA's language model's names in both
checkpoint layouts, targets given as PEFT's regex or "all-linear") and what is refused with a one-line reason
(modules_to_save, other targets, DoRA, ranks above the pool's, another base model's shapes, a
projection wrapped both alone and fused, a path that is no adapter)."""

from __future__ import annotations

import math
import re

import pytest
from lora_utils import AdapterSpec, make_peft_adapter
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Phi3Config

from llmserve.lora.adapter import AdapterLoadError, AdapterCache, read_adapter
from parity_utils import build_tiny_hf_model

CFG = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=128, max_position_embeddings=64)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return build_tiny_hf_model(LlamaConfig(**CFG), tmp_path_factory.mktemp("base"))


def test_scaling_rank_and_targets(hf, tmp_path):
    path = make_peft_adapter(hf, tmp_path / "a", AdapterSpec(r=4, alpha=8, targets=("q_proj", "down_proj")))
    adapter = read_adapter("a", path, hf.config, max_rank=8)
    assert adapter.rank == 4 and adapter.scaling == 2.0 and adapter.modules == {"q", "down"}
    assert adapter.weights[(1, "down")][0].shape == (4, 48) and adapter.weights[(1, "down")][1].shape == (32, 4)
    path = make_peft_adapter(hf, tmp_path / "rs", AdapterSpec(r=4, alpha=8, rslora=True))
    assert read_adapter("rs", path, hf.config, max_rank=8).scaling == 8 / math.sqrt(4)


@pytest.mark.parametrize("spec,max_rank,why", [
    (AdapterSpec(r=4, extra={"modules_to_save": ["lm_head"]}), 8, "modules_to_save (lm_head) is not supported"),
    (AdapterSpec(r=4, targets=("q_proj", "embed_tokens")), 8, "target_modules ['embed_tokens'] are not supported"),
    (AdapterSpec(r=4, extra={"use_dora": True}), 8, "use_dora is not supported"),
    (AdapterSpec(r=16), 8, "rank 16 is above --max-lora-rank 8"),
])
def test_refused(hf, tmp_path, spec, max_rank, why):
    path = make_peft_adapter(hf, tmp_path / "x", spec)
    with pytest.raises(AdapterLoadError, match=re.escape(f"LoRA adapter 'x': {why}")):
        read_adapter("x", path, hf.config, max_rank)


def test_another_base_models_adapter_is_refused(hf, tmp_path):
    path = make_peft_adapter(hf, tmp_path / "x", AdapterSpec(r=2))
    wider = LlamaConfig(**{**CFG, "hidden_size": 64})
    with pytest.raises(AdapterLoadError, match="an adapter of another base model"):
        read_adapter("x", path, wider, 8)


def test_a_path_that_is_no_adapter(tmp_path):
    with pytest.raises(AdapterLoadError, match="is not a directory"):
        read_adapter("x", str(tmp_path / "missing"), None, 8)
    with pytest.raises(AdapterLoadError, match="cannot read"):
        read_adapter("x", str(tmp_path), None, 8)


def test_cache_keeps_the_most_recent(hf, tmp_path):
    dirs = {n: make_peft_adapter(hf, tmp_path / n, AdapterSpec(r=2, seed=i)) for i, n in enumerate("abc")}
    cache = AdapterCache(dirs, hf.config, 8, capacity=2)     # each read (and checked) at start
    assert list(cache._read) == ["b", "c"]
    assert cache.get("a", dirs["a"]).name == "a" and list(cache._read) == ["c", "a"]


def test_fused_modules_split_into_their_parts(tmp_path):
    """Phi-3's qkv_proj: one A for q, k and v, B's rows cut at q's and k's outputs (gate_up_proj:
    gate's, then up's); an adapter also naming q_proj on its own is refused."""
    cfg = Phi3Config(**CFG, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = build_tiny_hf_model(cfg, tmp_path / "phi3")
    path = make_peft_adapter(hf, tmp_path / "a", AdapterSpec(r=4, targets=("qkv_proj", "gate_up_proj")))
    adapter = read_adapter("a", path, cfg, max_rank=8)
    assert adapter.modules == {"q", "k", "v", "gate", "up"}
    tensors = load_file(f"{path}/adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1"
    a, b = tensors[f"{prefix}.self_attn.qkv_proj.lora_A.weight"], tensors[f"{prefix}.self_attn.qkv_proj.lora_B.weight"]
    q, kv = 32, 16      # 4 heads of 8, 2 of them for k and v
    for part, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, q + 2 * kv))):
        assert adapter.weights[(1, part)][0].equal(a) and adapter.weights[(1, part)][1].equal(b[rows])
    b = tensors[f"{prefix}.mlp.gate_up_proj.lora_B.weight"]
    assert adapter.weights[(1, "gate")][1].equal(b[:48]) and adapter.weights[(1, "up")][1].equal(b[48:])
    tensors[f"{prefix}.self_attn.q_proj.lora_A.weight"] = a.clone()
    qkv_b = tensors[f"{prefix}.self_attn.qkv_proj.lora_B.weight"]
    tensors[f"{prefix}.self_attn.q_proj.lora_B.weight"] = qkv_b[:q].clone()
    save_file(tensors, f"{path}/adapter_model.safetensors")
    with pytest.raises(AdapterLoadError, match="layer 1 wraps q_proj twice"):
        read_adapter("a", path, cfg, max_rank=8)


@pytest.mark.parametrize("prefix", ["base_model.model.model.language_model.layers",
                                    "base_model.model.language_model.model.layers"])
def test_a_llavas_language_model_names(hf, tmp_path, prefix):
    """A LLaVA's adapter names its decoder's layers under ``language_model`` (where transformers
    4.52+ puts it, and where llava-hf's older checkpoints have it): read as a causal LM's."""
    path = make_peft_adapter(hf, tmp_path / "a", AdapterSpec(r=2, targets="all-linear"))
    want = read_adapter("a", path, hf.config, 8)
    assert want.modules == {"q", "k", "v", "o", "gate", "up", "down"}      # all-linear: the seven
    tensors = load_file(f"{path}/adapter_model.safetensors")
    save_file({k.replace("base_model.model.model.layers", prefix): t for k, t in tensors.items()},
              f"{path}/adapter_model.safetensors")
    got = read_adapter("a", path, hf.config, 8)
    assert got.weights.keys() == want.weights.keys()
    assert all(g.equal(w) for key in want.weights for g, w in zip(got.weights[key], want.weights[key]))
