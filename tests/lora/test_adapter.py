"""Reading PEFT adapter directories: what is served (scaling, rsLoRA, ranks, targets) and what is
refused with a one-line reason (modules_to_save, other targets, DoRA, ranks above the pool's,
another base model's shapes, a path that is no adapter)."""

from __future__ import annotations

import math
import re

import pytest
from lora_utils import AdapterSpec, make_peft_adapter
from transformers import LlamaConfig

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
