"""LoRA through the offline engine (``LLM``): each adapter's greedy tokens equal PEFT's, a batch
mixing the base model and three adapters gives each prompt what it gets alone, adapters load on
demand into fewer slots than there are adapters, and the prefix cache never serves one adapter's
KV to another."""

from __future__ import annotations

import pytest
import torch
from lora_utils import ALL_TARGETS, AdapterSpec, make_peft_adapter, peft_greedy, peft_model_of
from transformers import LlamaConfig

from llmserve import LLM, SamplingParams
from llmserve.sampling_params import InvalidRequest
from parity_utils import build_tiny_hf_model, random_prompts

ADAPTERS = {
    "a": AdapterSpec(r=4, targets=("q_proj", "v_proj", "down_proj"), seed=1),
    "b": AdapterSpec(r=8, targets=ALL_TARGETS, rslora=True, alpha=4, seed=2),
    "c": AdapterSpec(r=2, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), alpha=32, seed=3),
}
STEPS = 8


# The plain loop; the overlapped loop with prompt-lookup drafts (verify steps carry adapters);
# two pipeline stages (a layer each: every stage adds its own layers' adapter products).
ENGINES = {"plain": {}, "overlap-speculate": {"overlap": True, "speculate": 3}, "pp2": {"pp": 2}}


@pytest.fixture(scope="module", params=list(ENGINES))
def setup(request, tmp_path_factory, smollm2_tokenizer):
    if ENGINES[request.param].get("pp", 1) > 1 and torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("pp=2 needs 2 GPUs")
    path = tmp_path_factory.mktemp("lora-engine")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(smollm2_tokenizer), max_position_embeddings=256)
    hf = build_tiny_hf_model(cfg, path)
    smollm2_tokenizer.save_pretrained(path)
    dirs = {name: make_peft_adapter(hf, path / f"adapter-{name}", spec) for name, spec in ADAPTERS.items()}
    # Two slots for three adapters: the third loads on demand, evicting the least recently used.
    # float32 on a GPU too: the tokens are held to PEFT's in float32
    llm = LLM(str(path), dtype="float32", lora_modules=dirs, max_loras=2, max_lora_rank=8, max_total_token_num=2048,
              max_running_requests=8, **ENGINES[request.param])
    yield llm, peft_model_of(hf, dirs)
    llm.close()


def _greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)


def test_mixed_batch_equals_peft(setup):
    llm, peft_model = setup
    prompts = [p * 3 for p in random_prompts([2, 3, 2, 4], 1000, seed=3)]   # repeats: drafts to verify
    loras = [None, "a", "b", "c"]
    outs = llm.generate(prompts, _greedy(), lora=loras)
    for out, prompt, lora in zip(outs, prompts, loras):
        assert out.token_ids == peft_greedy(peft_model, lora, prompt, STEPS)[0], lora
    if llm.engine.config.speculate:
        assert llm.engine.num_draft_tokens > 0
    # Each alone: the same tokens.
    for prompt, lora, out in zip(prompts, loras, outs):
        assert llm.generate([prompt], _greedy(), lora=lora)[0].token_ids == out.token_ids


def test_prefix_cache_is_keyed_by_adapter(setup):
    """The same prompt under adapter a, then b, then the base model: each is PEFT's for its own
    adapter. Without the adapter in the cache's key, b would start from a's cached KV."""
    llm, peft_model = setup
    prompt = random_prompts([24], 1000, seed=9)[0]
    for lora in ["a", "b", None, "a"]:
        (out,) = llm.generate([prompt], _greedy(), lora=lora)
        assert out.token_ids == peft_greedy(peft_model, lora, prompt, STEPS)[0], lora
    # The cache did serve the repeat of adapter a (a hit is allowed within one adapter).
    assert out.num_cached_tokens > 0


def test_unknown_adapter_is_refused(setup):
    llm, _ = setup
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'nope'"):
        llm.generate([[1, 2, 3]], _greedy(), lora="nope")
