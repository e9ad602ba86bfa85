"""Prompt-lookup speculation (``EngineConfig.speculate``) gives exactly the greedy output of
decoding one token per step on tiny random models of each architecture: at tp=2, with requests
that do not draft, under a KV cache small enough to preempt, chunked prefill, and the overlapped
loop, where every step, drafting or not, must stay overlapped (``overlapped`` checks each call to
the workers). The embedded model's input-grounded prompts, where drafts are accepted and stops
fall inside accepted runs, are test_speculation_grounded.py's (a module of its own, so that
pytest-xdist runs the two on both workers).

The plain side of each comparison is the same engine with ``SamplingParams.speculate=False``
(the request-level switch), so the two differ only in the drafts. Every engine here runs in
float32: on a GPU an fp32 checkpoint otherwise serves in bf16, where a verify step's few-row
products and a decode step's GEMV may round a near-tie apart (one bf16 step at 3.24 split the
preemption test's request 1 at its 38th token on an H200)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import BloomConfig, LlamaConfig

from llmserve import LLM, SamplingParams
from llmserve.engine.config import SPECULATE_MAX_BATCH, EngineConfig, with_device_defaults
from llmserve.engine.drafting import DraftCost
from llmserve.worker.prompt_lookup import LONG_MATCH, PromptLookup
from parity_utils import build_tiny_hf_model, build_tiny_llava
from speculation_utils import (MAX_BATCH, SPECULATE, assert_all_overlapped, assert_same_tokens, generate_counting,
                               overlapped, plain)

# Small vocabularies: a random model's greedy output soon cycles, and its prompt's n-grams recur,
# so drafts are proposed and some are accepted.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
# Each model class (qwen2 and mistral checkpoints run LlamaTpPartModel too); LLaVA's below.
ARCHITECTURES = {
    "llama-tied": lambda: LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=True),
    "bloom": lambda: BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=512, bos_token_id=1, eos_token_id=2),
}


def random_workload(vocab: int, n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        chunk = [rng.randrange(3, vocab) for _ in range(rng.choice([4, 9, 30]))]
        prompts.append(chunk * rng.choice([1, 2, 3]) + [rng.randrange(3, vocab) for _ in range(rng.choice([1, 5]))])
    params = [SamplingParams(max_new_tokens=rng.choice([3, 10, 20]), temperature=0, ignore_eos=i % 2 == 0,
                             speculate=i % 4 != 3, logprobs=2 if i % 3 == 1 else None) for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module", params=[*ARCHITECTURES, "llava"])
def tiny_model_dir(request, tmp_path_factory, smollm2_tokenizer) -> str:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llava":
        build_tiny_llava(path, smollm2_tokenizer)
    else:
        build_tiny_hf_model(ARCHITECTURES[request.param](), path)
        smollm2_tokenizer.save_pretrained(path)
    return str(path)


def test_greedy_equals_plain_on_each_architecture(tiny_model_dir):
    # A KV pool of the test's size: on a GPU the default one takes most of its memory.
    with LLM(tiny_model_dir, dtype="float32", speculate=SPECULATE, speculate_max_batch=MAX_BATCH, max_prefill_tokens=48,
             max_total_token_num=8192) as llm:
        prompts, params = random_workload(512, 6, seed=0)
        want = llm.generate(prompts, plain(params))
        got, accepted = generate_counting(llm, prompts, params)
    assert_same_tokens(got, want)
    # LLaVA's decoder has the tokenizer's whole vocabulary: its random output seldom recurs, so
    # drafts are rare there (the embedded model's tests below accept many).
    assert llm.engine.num_draft_tokens > 0 or "llava" in tiny_model_dir



@pytest.mark.parametrize("ranks", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_two_ranks_greedy_equal_plain(ranks, tmp_path, smollm2_tokenizer):
    # Only rank 0 verifies (at pp=2 it is stage 0, with the logits the last stage sends it): the
    # other rank learns what was kept from its next step's num_cached. The tied model's output
    # cycles, so drafts are accepted and rejected. float32 on a GPU too (bf16 is its default
    # there): a verify step's rows and a decode step's row come from different kernels, equal to
    # float32 rounding only (2 x H200: logprobs 1e-3 apart in bf16).
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two ranks need 2 GPUs")
    build_tiny_hf_model(ARCHITECTURES["llama-tied"](), tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    with LLM(str(tmp_path), dtype="float32", speculate=SPECULATE, speculate_max_batch=MAX_BATCH,
             max_total_token_num=8192, **ranks) as llm:
        prompts, params = random_workload(512, 6, seed=1)
        want = llm.generate(prompts, plain(params))
        got, accepted = generate_counting(llm, prompts, params)
        assert_same_tokens(got, want)
        assert accepted > 0 and llm.engine.num_draft_tokens > accepted
        # Overlapped: rank 0 fills each step in (the tokens of the verify before it, positions,
        # drafts) before the other rank gets it; at pp=2 stage 0 embeds the token drawn a step before.
        with overlapped(llm) as records:
            got, _ = generate_counting(llm, prompts, params)
        assert_same_tokens(got, want)
        assert_all_overlapped(records)
        # A step that carries no request (a flush of cache ops) between a draft and its request's
        # next step: the other rank must still drop that draft's rejected tokens then (it used to
        # forget them, and its next step found the row too long and the rank exited).
        engine = llm.engine
        reqs = [engine.new_request(p, dataclasses.replace(q, max_new_tokens=40, ignore_eos=True))
                for p, q in zip(prompts, params) if q.speculate]
        for req in reqs:
            engine.enqueue(req)
        drafted = engine.num_draft_tokens
        while engine.num_draft_tokens == drafted and engine.has_unfinished():
            engine.step()
        assert engine.num_draft_tokens > drafted and engine.has_unfinished()
        llm.reset_prefix_cache()
        while engine.has_unfinished():
            engine.step()
        engine.flush()
        assert all(len(r.output_token_ids) == 40 for r in reqs)


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    path = tmp_path_factory.mktemp("llama-tied")
    build_tiny_hf_model(ARCHITECTURES["llama-tied"](), path)
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


def test_overlapped_drafts_equal_plain_under_preemption(tied_llama_dir):
    # The plain side: no drafts and no overlap. A KV pool too small for the batch: requests with
    # drafts in flight are preempted, and prompts are chunked.
    with LLM(tied_llama_dir, dtype="float32", speculate=SPECULATE, speculate_max_batch=MAX_BATCH, max_prefill_tokens=48,
             max_total_token_num=192) as llm:
        # Drafts as long as their match allows: at batch 8 the CPU's costs (drafting.DRAFT_COSTS)
        # soon stop a random model's drafts, and this test is of the drafts' bookkeeping.
        llm.engine.scheduler.drafter.cost = DraftCost()
        prompts, params = random_workload(512, 8, seed=6)
        # Long enough that the random model's output cycles (drafts are accepted) and outgrows the pool.
        params = [dataclasses.replace(p, max_new_tokens=40) for p in params]
        want = llm.generate(prompts, plain(params))
        preemptions = llm.engine.scheduler.num_preemptions
        with overlapped(llm) as records:
            got, accepted = generate_counting(llm, prompts, params)
        assert_same_tokens(got, want)
        assert_all_overlapped(records)
        assert accepted > 0 and llm.engine.scheduler.num_preemptions > preemptions


def test_rank0_reports_each_requests_match_after_every_step(tied_llama_dir):
    """The drafter learns each drafting request's match from rank 0 after every step it samples
    (`StepOutput.match_lens`): what `PromptLookup.match_len` gives over the request's tokens with
    that step's, counted up to LONG_MATCH. The report of a request's last step is not checked: it
    comes when the request has finished, and under the overlapped loop (the GPU's) rank 0 may have
    forgotten the request by then (a retirement sent while that step was in flight: 0), or counted
    a verify's tokens past ``max_new_tokens``, which the engine drops. The random model's output
    cycles, so some matches are long (they end back-offs)."""
    reports: dict[int, list[tuple[int, int]]] = {}
    with LLM(tied_llama_dir, dtype="float32", speculate=SPECULATE, speculate_max_batch=MAX_BATCH, max_total_token_num=2048,
             overlap=True) as llm:
        drafter = llm.engine.scheduler.drafter
        matched = drafter.matched

        def record(req, match_len: int) -> None:     # (before the step's tokens are appended)
            reports.setdefault(req.req_id, []).append((req.num_output_tokens, match_len))
            matched(req, match_len)

        prompts, params = random_workload(512, 4, seed=3)
        params = [dataclasses.replace(p, max_new_tokens=30, ignore_eos=True, speculate=True) for p in params]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(drafter, "matched", record)
            outs = llm.generate(prompts, params)
    assert len(reports) == len(prompts)
    for prompt, out, got in zip(prompts, outs, reports.values()):
        tokens = [*prompt, *out.token_ids]
        ends = [n for n, _ in got[1:]] + [len(out.token_ids)]    # each step's tokens end where the next began
        want = [min(PromptLookup(tokens[: len(prompt) + end]).match_len(), LONG_MATCH) for end in ends]
        assert [m for _, m in got[:-1]] == want[:-1]
    assert max(m for got in reports.values() for _, m in got) >= LONG_MATCH


def test_max_batch_default_is_the_devices():
    # On a CPU a step's cost grows with its rows: there drafting stops at a smaller batch.
    config = EngineConfig(speculate=SPECULATE)
    assert with_device_defaults(config, "cpu").speculate_max_batch == SPECULATE_MAX_BATCH["cpu"] == 8
    assert with_device_defaults(config, "cuda").speculate_max_batch == SPECULATE_MAX_BATCH["cuda"] == 32
    assert with_device_defaults(dataclasses.replace(config, speculate_max_batch=2), "cpu").speculate_max_batch == 2
    assert config.speculate_max_batch is None      # the caller's config is left as it was
