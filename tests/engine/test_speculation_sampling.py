"""Sampling with prompt-lookup speculation draws from the distribution sampling without it draws
from, end to end (``LLM(..., speculate=K)``: drafts, the verify step, the engine's runs).

A tiny random model with a 64-token vocabulary (cheap to sample from many times) decodes a prompt that ends in its own greedy run, so that the drafts prompt
lookup finds are tokens it gives real probability to (top-3 sampling), and many are accepted.
Seeded requests with speculation and without (``SamplingParams.speculate``) are compared on
their first tokens by a two-sample chi-square test; fixed seeds make it deterministic.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.drafting import DraftCost
from parity_utils import build_tiny_hf_model

DTYPE = os.environ.get("LLMSERVE_TEST_DTYPE")
NUM_SAMPLES = 300     # per arm
NUM_TOKENS = 4        # the first comes from the prefill; drafts verify the ones after it


VOCAB = 64


@pytest.fixture(scope="module")
def small_vocab_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama over a word-level tokenizer of VOCAB tokens (the last one EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("small-vocab-llama")
    words = {f"w{i}": i for i in range(VOCAB - 1)} | {"<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    build_tiny_hf_model(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                                    eos_token_id=VOCAB - 1, bos_token_id=0), path)
    return str(path)


@pytest.fixture(scope="module")
def llm(small_vocab_llama_dir):
    # Every request of the batch drafts (the default cap would switch drafting off for this batch).
    with LLM(small_vocab_llama_dir, dtype=DTYPE, speculate=4, speculate_max_batch=2 * NUM_SAMPLES) as llm:
        # Drafts as long as their match allows: at a batch of NUM_SAMPLES the CPU's costs
        # (drafting.DRAFT_COSTS) rightly draft nothing, and this test is of what drafts sample.
        llm.engine.scheduler.drafter.cost = DraftCost()
        yield llm


def two_sample_chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic for two samples of equal size, and its degrees of freedom; cells with
    fewer than 10 draws in both samples together are pooled into one."""
    stat, cells, pooled_a, pooled_b = 0.0, 0, 0, 0
    for cell in set(a) | set(b):
        x, y = a.get(cell, 0), b.get(cell, 0)
        if x + y < 10:
            pooled_a, pooled_b = pooled_a + x, pooled_b + y
            continue
        stat += (x - y) ** 2 / (x + y)
        cells += 1
    if pooled_a + pooled_b:
        stat += (pooled_a - pooled_b) ** 2 / (pooled_a + pooled_b)
        cells += 1
    return stat, cells - 1


@pytest.mark.parametrize("overlap", [False, True])
def test_speculative_sampling_keeps_the_distribution(llm: LLM, overlap: bool):
    start = list(range(1, 9))
    own_run = llm.generate([start], SamplingParams(temperature=0.0, max_new_tokens=24))[0].token_ids
    prompt = start + own_run

    def params(seed: int, speculate: bool) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_k=3, max_new_tokens=NUM_TOKENS, seed=seed, speculate=speculate,
                              ignore_eos=True)

    drafted, accepted = llm.engine.num_draft_tokens, llm.engine.num_accepted_tokens
    llm.engine.overlap = overlap       # (drafts stay in the overlapped loop: test_speculation.py)
    try:
        with_spec = llm.generate([prompt] * NUM_SAMPLES, [params(i, True) for i in range(NUM_SAMPLES)])
    finally:
        llm.engine.overlap = False
    drafted, accepted = llm.engine.num_draft_tokens - drafted, llm.engine.num_accepted_tokens - accepted
    without = llm.generate([prompt] * NUM_SAMPLES, [params(10**6 + i, False) for i in range(NUM_SAMPLES)])
    # (On a GPU fewer requests draft than on the CPU: 271 draft tokens there, 600 here.)
    assert drafted > NUM_SAMPLES // 2 and accepted > 0.2 * drafted, "the test needs drafts, and drafts accepted"

    a = Counter(tuple(o.token_ids) for o in with_spec)
    b = Counter(tuple(o.token_ids) for o in without)
    assert all(len(o.token_ids) == NUM_TOKENS for o in with_spec + without)
    stat, dof = two_sample_chi_square(a, b)
    # Far in the tail (p ~ 1e-6) for these degrees of freedom.
    assert stat < dof + 7 * math.sqrt(2 * dof)
