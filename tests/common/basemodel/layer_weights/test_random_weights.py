"""``--load-format dummy``: random weights drawn from a config alone must be a complete checkpoint
of the family's published layout (HF transformers, loading the same tensors from a file, computes
the same logits), the same on every tensor-parallel rank, and refused clearly where not drawn."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from llmserve.common.basemodel.layer_weights.random_weights import RANDOM_WEIGHT_MODEL_TYPES, check_load_format, random_hf_weights
from llmserve.engine.config import EngineConfig, inspect_model
from llmserve.tokenizer import load_tokenizer
from parity_utils import BatchDriver, TEST_DEVICE, TEST_DTYPE, LOGITS_TOL, load_ours, random_prompts, rel_err, tp2_logits
from test_llm import skip_without_two_ranks

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, vocab_size=256, max_position_embeddings=256)
FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen3": {},
    "gemma2": dict(query_pre_attn_scalar=16, sliding_window=32, tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True),
}
PROMPTS = random_prompts([5, 9], SMALL["vocab_size"])


def config_dir(path, model_type: str) -> str:
    AutoConfig.for_model(model_type, **SMALL, **FAMILIES[model_type]).save_pretrained(path)
    return str(path)


def test_every_family_drawn_is_tested():
    assert set(FAMILIES) == RANDOM_WEIGHT_MODEL_TYPES


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_dummy_weights_are_a_checkpoint_hf_reads_the_same(model_type, tmp_path):
    """Ours from the config alone against HF from the same tensors written as a safetensors file
    (per-expert tensors as published: transformers converts them to its own layout on load)."""
    path = config_dir(tmp_path, model_type)
    ours = load_ours(path, load_format="dummy")
    raw = AutoConfig.from_pretrained(path).to_dict()
    tensors = {k: v for layer in random_hf_weights(raw, "cpu", TEST_DTYPE) for k, v in layer.items()}
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    # Scale 0.02 leaves the logits near zero: compare them in a spread-out form.
    driver = BatchDriver(ours)
    got = driver.prefill(PROMPTS).float().cpu()
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    assert rel_err(got, want) < LOGITS_TOL, model_type


def _dummy_driver(path: str, rank: int, world: int) -> BatchDriver:
    return BatchDriver(load_ours(path, load_format="dummy", tp_rank=rank, world_size=world))


def test_every_rank_draws_the_same_weights(tmp_path):
    """tp=2 from random weights computes tp=1's logits: each rank drew every tensor whole from
    one seed and kept its share."""
    skip_without_two_ranks()
    path = config_dir(tmp_path / "model", "llama")
    driver = _dummy_driver(path, 0, 1)
    want = {"prefill": driver.prefill(PROMPTS), "decode": driver.decode([1, 2])}
    got = tp2_logits(functools.partial(_dummy_driver, path), PROMPTS, str(tmp_path / "tp2.pt"))
    for step in want:
        assert rel_err(got[step].float().cpu(), want[step].float().cpu()) < LOGITS_TOL, step


@pytest.mark.parametrize("load_format, model_type, path, message", [
    ("safetensors", "llama", "/m", "load format must be one of auto, dummy"),
    ("dummy", "llama", "/m/model.gguf", "not a GGUF file"),
    ("dummy", "phi3", "/m", "this one is 'phi3'"),
])
def test_refused_at_the_edge(load_format, model_type, path, message):
    with pytest.raises(ValueError, match=message):
        check_load_format(load_format, model_type, path)


def test_inspect_model_checks_the_load_format(tiny_bloom_dir):
    """The front end refuses dummy weights for a family they are not drawn for before any worker starts."""
    with pytest.raises(ValueError, match="this one is 'bloom'"):
        inspect_model(EngineConfig(model=tiny_bloom_dir, load_format="dummy", device=TEST_DEVICE),
                      load_tokenizer(tiny_bloom_dir))
