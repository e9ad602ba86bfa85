"""Pipeline parallelism end to end through the offline engine: pp=2 (two gloo processes on a CPU,
two GPUs where there is CUDA), each stage holding one of the tiny model's two layers, gives
pp=1's greedy tokens and prompt logprobs; a batch of prompts of different lengths, one longer
than a prefill chunk, and prefix-cache hits. pp=2 x tp=2 too. What pp does not support yet is
refused before any worker loads. (The stages' split against HF logits, for every family:
tests/models/test_pipeline_parallel.py; two nodes: tests/worker/test_node.py; speculation:
tests/engine/test_speculation.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.config import EngineConfig, check_pipeline, inspect_model
from parity_utils import EXACT

DTYPE = os.environ.get("LLMSERVE_TEST_DTYPE")
KV_TOKENS = 4096
PREFILL_TOKENS = 32          # the long prompt below (48 tokens) takes two steps
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "a",
           "Once upon a time, " * 8 + "in a land far away, there lived"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)


def skip_without_ranks(n: int) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        pytest.skip(f"{n} ranks need {n} GPUs")


def engine(path: str, **kw) -> LLM:
    # pp=1 as pp > 1 runs: eager (a graph's padded batch may tile its matmuls otherwise) and not
    # overlapped (the same batches step by step). On the GPU machine run with
    # LLMSERVE_TEST_DTYPE=float32 for exact tokens (as test_llm.py).
    return LLM(path, dtype=DTYPE, max_total_token_num=KV_TOKENS, max_prefill_tokens=PREFILL_TOKENS,
               cuda_graph_max_bs=0, overlap=False, **kw)


@pytest.fixture(scope="module")
def pp1(tiny_llama_dir):
    """pp=1's outputs of PROMPTS and its WorkerInfo."""
    with engine(tiny_llama_dir) as llm:
        return llm.generate(PROMPTS, GREEDY), llm.engine.info


@pytest.fixture(scope="module")
def expected(pp1):
    return pp1[0]


@pytest.fixture(scope="module")
def pp2(tiny_llama_dir):
    skip_without_ranks(2)
    with engine(tiny_llama_dir, pp=2) as llm:
        yield llm


def assert_same(got, expected) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    atol = 1e-4 if EXACT else 5e-2
    for g, e in zip(got, expected):
        assert g.prompt_logprobs[0] is None and g.prompt_logprobs[1:] == pytest.approx(e.prompt_logprobs[1:], abs=atol)


def test_two_stages_give_one_stage_tokens_and_prompt_logprobs(pp2, pp1):
    expected, pp1_info = pp1
    assert len(pp2.tokenizer(PROMPTS[-1]).input_ids) > PREFILL_TOKENS
    assert_same(pp2.generate(PROMPTS, GREEDY), expected)
    assert "pp=2 (layers 0 | 1)" in pp2.engine.summary()
    info = pp2.engine.info
    assert info.all_reduce == ""      # stages of one rank: no all-reduce to name
    assert info.max_total_token_num == KV_TOKENS and info.num_layers == 2
    # the stages' weights add up to the model's (an untied lm_head: no tensor held twice)
    assert (info.num_params, info.weight_bytes) == (pp1_info.num_params, pp1_info.weight_bytes)


def test_two_stages_serve_prefix_cache_hits(pp2, expected):
    pp2.reset_prefix_cache()
    pp2.generate(PROMPTS[-1:], GREEDY)           # caches the long prompt
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    [warm] = pp2.generate(PROMPTS[-1:], params)
    assert warm.num_cached_tokens > PREFILL_TOKENS
    assert warm.token_ids == expected[-1].token_ids


def test_two_stages_of_two_tensor_parallel_ranks_give_one_rank_tokens(tiny_llama_dir, expected):
    skip_without_ranks(4)
    with engine(tiny_llama_dir, tp=2, pp=2) as llm:
        assert_same(llm.generate(PROMPTS, GREEDY), expected)
        assert "tp=2" in llm.engine.summary() and "pp=2" in llm.engine.summary()


@pytest.mark.parametrize("options, message", [
    (dict(pp=3), "pp=3 stages need at least one layer each; the model has 2"),
    (dict(pp=0), "pp must be >= 1, got 0"),
    (dict(pp=2, tp=2, custom_all_reduce=True), "custom all-reduce .* not supported with pp > 1 yet"),
    (dict(pp=3, nnodes=2, dist_init_addr="127.0.0.1:1"), "tp x pp = 3 does not split over nnodes=2"),
])
def test_what_stages_cannot_run_is_refused_before_loading(tiny_llama_dir, options, message):
    with pytest.raises(ValueError, match=message):
        inspect_model(EngineConfig(model=tiny_llama_dir, **options), None)


def test_a_family_that_cannot_split_is_refused_before_loading(tiny_bloom_dir):
    with pytest.raises(ValueError, match="pipeline parallelism .pp > 1. is not supported for bloom models yet"):
        inspect_model(EngineConfig(model=tiny_bloom_dir, pp=2), None)


def test_the_custom_all_reduce_default_stands_aside_between_stages(tiny_llama_dir):
    """The custom all-reduce is on by default at tp > 1, but not yet over a stage's tp group: left to
    its default, pp > 1 runs NCCL's (asked for, it is refused above)."""
    assert EngineConfig(tp=2).uses_custom_all_reduce
    assert not EngineConfig(tp=2, custom_all_reduce=False).uses_custom_all_reduce
    config = EngineConfig(model=tiny_llama_dir, tp=2, pp=2)
    check_pipeline(config)                          # not refused
    assert not config.uses_custom_all_reduce
