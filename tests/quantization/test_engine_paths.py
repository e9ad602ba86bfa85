"""Quantized weights (``--quantization fp8``) and a float8 KV cache (``--kv-cache-dtype fp8``) on the
engine's other step paths: the overlapped loop and prompt-lookup speculation (a verify step
attends over the float8 cache through the context kernel, with the rejected drafts' slots
rewritten) give the tokens that plain decoding gives with the same model, on the CPU (the torch
twins), as issue 32 asks of quantized models."""

from __future__ import annotations

import dataclasses
import random

import pytest
from transformers import LlamaConfig

from llmserve import LLM, SamplingParams
from parity_utils import build_tiny_hf_model

# A small vocabulary: a random model's greedy output soon cycles and its prompts' n-grams recur,
# so drafts are proposed and accepted.
VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-512")
    build_tiny_hf_model(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                                    bos_token_id=1, eos_token_id=2), path)
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


def workload(n: int = 6, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        chunk = [rng.randrange(3, VOCAB) for _ in range(rng.choice([4, 9, 30]))]
        prompts.append(chunk * rng.choice([1, 2, 3]) + [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 5]))])
    params = [SamplingParams(max_new_tokens=rng.choice([10, 20]), temperature=0, ignore_eos=True, speculate=False)
              for _ in range(n)]
    return prompts, params


def test_overlap_and_speculation_keep_the_tokens(model_dir):
    """Both at once (one engine: the suite's time): FP8 weights and the float8 cache."""
    options = dict(quantization="fp8", kv_cache_dtype="fp8")
    prompts, params = workload()
    speculating = [dataclasses.replace(p, speculate=True) for p in params]
    # chunked prompts (48 tokens a step) and a small pool: chunks attend over a float8 prefix
    with LLM(model_dir, speculate=8, speculate_max_batch=32, max_prefill_tokens=48, max_total_token_num=1024,
             **options) as llm:
        def run(overlap: bool, p: list[SamplingParams]) -> list[list[int]]:
            llm.engine.overlap = overlap
            llm.reset_prefix_cache()   # each run from a cold cache, as the first
            try:
                return [o.token_ids for o in llm.generate(prompts, p)]
            finally:
                llm.engine.overlap = False

        want = run(False, params)
        assert run(True, params) == want
        assert run(False, speculating) == want
        assert llm.engine.num_accepted_tokens > 0
        assert run(True, speculating) == want
        info = llm.engine.info
    assert "fp8" in info.quantization and info.kv_cache_dtype.startswith("fp8_e4m3")
