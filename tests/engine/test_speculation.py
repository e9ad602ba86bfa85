"""Prompt-lookup speculation (``EngineConfig.speculate``) gives exactly the greedy output of
decoding one token per step: on tiny random models of each architecture, and on the embedded
model's input-grounded prompts, where drafts are accepted, mixed with requests that do not draft,
with stop ids, stop strings and max_new_tokens falling inside accepted runs, under a KV cache
small enough to preempt, chunked prefill, and the overlapped loop, where every step, drafting or
not, must stay overlapped (``overlapped`` checks each call to the workers).

The plain side of each comparison is the same engine with ``SamplingParams.speculate=False``
(the request-level switch), so the two differ only in the drafts."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator

import pytest
import torch
from transformers import BloomConfig, LlamaConfig

from llmserve import LLM, SamplingParams
from llmserve.engine.config import SPECULATE_MAX_BATCH, EngineConfig, with_device_defaults
from llmserve.engine.drafting import DraftCost
from llmserve.engine.engine import LLMEngine
from parity_utils import build_tiny_hf_model, build_tiny_llava

SPECULATE = 10
# Every test batches drafting requests: above the CPU's default (1) they would draft nothing.
MAX_BATCH = 32
# Small vocabularies: a random model's greedy output soon cycles, and its prompt's n-grams recur,
# so drafts are proposed and some are accepted.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
# Each model class (qwen2 and mistral checkpoints run LlamaTpPartModel too); LLaVA's below.
ARCHITECTURES = {
    "llama-tied": lambda: LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=True),
    "bloom": lambda: BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=512, bos_token_id=1, eos_token_id=2),
}


def plain(params: list[SamplingParams]) -> list[SamplingParams]:
    return [dataclasses.replace(p, speculate=False) for p in params]


def generate_counting(llm: LLM, prompts, params) -> tuple[list, int]:
    """Outputs, and how many draft tokens the engine accepted meanwhile. No forward may fail: the
    engine would run the step again and hide, say, a KV row the worker left too long."""
    before = llm.engine.num_accepted_tokens

    def no_failed_forward(self, plan):
        raise AssertionError("a forward failed")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLMEngine, "_run_again", no_failed_forward)
        outs = llm.generate(prompts, params)
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.num_used_slots == 0
    return outs, llm.engine.num_accepted_tokens - before


def assert_same_tokens(got, want) -> None:
    """Equal tokens, text and finish reasons; equal logprobs of every token to float rounding (a
    verify step computes a run's rows in one forward, a plain decode one row a step)."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), i
        assert (g.logprobs is None) == (w.logprobs is None) and (g.logprobs is None or g.logprobs == pytest.approx(w.logprobs, abs=1e-3)), i
        for top_g, top_w in zip(g.top_logprobs or [], w.top_logprobs or [], strict=True):
            assert [v for _, v in top_g] == pytest.approx([v for _, v in top_w], abs=1e-3), i


@contextlib.contextmanager
def overlapped(llm: LLM) -> Iterator[list[tuple[bool, bool, bool]]]:
    """The engine under the overlapped loop; yields, per call to the workers that sent a batch,
    whether it was overlapped, whether it granted draft budgets, and whether the workers answered
    with its own output at once (a synchronous step)."""
    engine = llm.engine
    records: list[tuple[bool, bool, bool]] = []
    send = engine.workers.step

    def recording(step):
        in_flight = len(engine._in_flight)       # the steps sent before it whose output is owed
        outputs = send(step)
        if step.entries:
            records.append((step.overlap, any(e.draft_budget for e in step.entries), len(outputs) > in_flight))
        return outputs

    engine.workers.step, engine.overlap = recording, True
    try:
        yield records
    finally:
        del engine.workers.step
        engine.overlap = False


def assert_all_overlapped(records: list[tuple[bool, bool, bool]]) -> None:
    """Every step overlapped and answered a step late, drafting ones included (and there were some)."""
    assert records and any(drafts for _, drafts, _ in records)
    assert all(overlap and not at_once for overlap, _, at_once in records), \
        [r for r in records if not r[0] or r[2]][:5]


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
    with LLM(tiny_model_dir, speculate=SPECULATE, speculate_max_batch=MAX_BATCH, max_prefill_tokens=48, max_total_token_num=8192) as llm:
        prompts, params = random_workload(512, 6, seed=0)
        want = llm.generate(prompts, plain(params))
        got, accepted = generate_counting(llm, prompts, params)
    assert_same_tokens(got, want)
    # LLaVA's decoder has the tokenizer's whole vocabulary: its random output seldom recurs, so
    # drafts are rare there (the embedded model's tests below accept many).
    assert llm.engine.num_draft_tokens > 0 or "llava" in tiny_model_dir



def test_tp2_greedy_equals_plain(tmp_path, smollm2_tokenizer):
    # Only rank 0 verifies: rank 1 learns what was kept from its next step's num_cached. The tied
    # model's output cycles, so drafts are accepted and rejected.
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tp=2 needs 2 GPUs")
    build_tiny_hf_model(ARCHITECTURES["llama-tied"](), tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    with LLM(str(tmp_path), tp=2, speculate=SPECULATE, speculate_max_batch=MAX_BATCH) as llm:
        prompts, params = random_workload(512, 6, seed=1)
        want = llm.generate(prompts, plain(params))
        got, accepted = generate_counting(llm, prompts, params)
        assert_same_tokens(got, want)
        assert accepted > 0 and llm.engine.num_draft_tokens > accepted
        # Overlapped: rank 0 fills each step in (the tokens of the verify before it, positions,
        # drafts) before rank 1 gets it.
        with overlapped(llm) as records:
            got, _ = generate_counting(llm, prompts, params)
        assert_same_tokens(got, want)
        assert_all_overlapped(records)
        # A step that carries no request (a flush of cache ops) between a draft and its request's
        # next step: rank 1 must still drop that draft's rejected tokens then (it used to forget
        # them, and its next step found the row too long and the rank exited).
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
    with LLM(tied_llama_dir, speculate=SPECULATE, speculate_max_batch=MAX_BATCH, max_prefill_tokens=48,
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


# -- the embedded model, on prompts whose answers copy from them ----------------------------------

def grounded_prompts(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    """Chat prompts built from this repository's own text, greedy: edit a function, repeat a
    passage, repeat another under a grammar (a choice of that passage alone: the verifier judges
    each draft token by it), and summarise a passage without drafts."""
    import inspect

    from llmserve.engine import request, scheduler
    from llmserve.sampling_params import GuidedDecodingParams

    source = inspect.getsource(request.Request.token_slice)
    doc_start, doc_end = source.index('"""'), source.rindex('"""') + 3
    code = source[:doc_start].rstrip() + source[doc_end:]          # the function without its docstring
    passage, other = inspect.getdoc(request).split("\n\n")[1], inspect.getdoc(scheduler).split(". ")[0] + "."
    asks = [f"Here is a Python function:\n\n{code}\nRename the argument start to begin and output the whole function.",
            f"Repeat the following text exactly.\n\n{passage}",
            f"Repeat the following text exactly.\n\n{other}",
            f"Passage:\n{passage}\n\nSummarise the passage in one sentence."]
    prompts = [llm.chat_prompt([{"role": "user", "content": ask}]) for ask in asks]
    params = [SamplingParams(max_new_tokens=32, temperature=0) for _ in asks]
    params[2].guided_decoding = GuidedDecodingParams(choice=(other,))
    params[3].speculate = False
    return prompts, params


@pytest.fixture(scope="module")
def llm(default_model_path):
    with LLM(default_model_path, speculate=SPECULATE, speculate_max_batch=MAX_BATCH) as llm:
        # Drafts as long as their match allows (the policy's cuts are test_drafting.py's): long
        # accepted runs, for the stops placed inside them.
        llm.engine.scheduler.drafter.cost = DraftCost()
        yield llm


@pytest.fixture(scope="module")
def free_run(llm):
    """The grounded prompts (the last one never drafts) run plain and speculating, with the
    tokens each request got per step of the speculating run."""
    prompts, params = grounded_prompts(llm)
    want = llm.generate(prompts, plain(params))
    counts: dict[int, list[int]] = {}     # req_id -> its number of tokens per step
    step = LLMEngine.step

    def recording_step(self):
        deltas = step(self)
        per_request: dict[int, int] = {}
        for d in deltas:
            per_request[d.req_id] = per_request.get(d.req_id, 0) + 1
        for req_id, n in per_request.items():
            counts.setdefault(req_id, []).append(n)
        return deltas

    mp = pytest.MonkeyPatch()
    mp.setattr(LLMEngine, "step", recording_step)
    try:
        got, accepted = generate_counting(llm, prompts, params)
    finally:
        mp.undo()
    runs = [counts[req_id] for req_id in sorted(counts)]   # ids are given in prompt order
    return prompts, params, want, got, accepted, runs


def test_grounded_prompts_accept_drafts_and_equal_plain(free_run):
    prompts, params, want, got, accepted, runs = free_run
    assert_same_tokens(got, want)
    assert accepted >= 10, "grounded prompts should have drafts accepted"
    assert max(runs[-1]) == 1, "the request with speculate=False never drafts"
    assert max(max(r) for r in runs[:-1]) >= 3


def run_starts(counts: list[int]) -> list[tuple[int, int]]:
    """(first output index, length) of each step's tokens."""
    starts, at = [], 0
    for n in counts:
        starts.append((at, n))
        at += n
    return starts


def test_stops_and_lengths_inside_accepted_runs_under_preemption_chunking_and_overlap(llm, free_run):
    # A stop id, a stop string and max_new_tokens placed inside runs the free run accepted; the
    # KV cache too small for the batch (preemptions), prompts prefilled in chunks, and the
    # overlapped loop.
    prompts, params, want, got, _, runs = free_run
    params = [dataclasses.replace(p) for p in params]
    placed = []
    text_of = llm.tokenizer.decode
    for i, p in enumerate(params[:-1]):
        tokens = got[i].token_ids
        # A token inside an accepted run that neither occurs nor (as text) shows earlier: the
        # latest, so that the requests run long enough to outgrow the KV cache below.
        at = [start + 1 for start, n in run_starts(runs[i]) if n >= 3 and tokens[start + 1] not in tokens[: start + 1]
              and text_of(tokens[start + 1 : start + 2]).strip()
              and text_of(tokens[start + 1 : start + 2]) not in text_of(tokens[: start + 1])][-1]
        if i % 3 == 0:
            p.stop_token_ids = [tokens[at]]
        elif i % 3 == 1:
            p.stop = [text_of(tokens[at : at + 1])]
        else:
            p.max_new_tokens = at + 1
        placed.append(at)
    scheduler = llm.engine.scheduler
    saved = dataclasses.replace(scheduler.config)
    preemptions = scheduler.num_preemptions
    # All prompts start in the first step, the last one split over two (chunked prefill), with
    # room for a few tokens more than they hold (their common chat-template prefix is cached once):
    # the growing decodes soon preempt the newest.
    total = sum(len(p) for p in prompts)
    common = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    scheduler.config.max_total_token_num = total - (len(prompts) - 1) * common + 8
    scheduler.config.max_prefill_tokens = total - 40
    try:
        want = llm.generate(prompts, plain(params))
        with overlapped(llm) as records:
            got, accepted = generate_counting(llm, prompts, params)
    finally:
        scheduler.config = saved
    assert_same_tokens(got, want)
    assert_all_overlapped(records)
    assert scheduler.num_preemptions > preemptions and accepted > 0
    for i, at in enumerate(placed):
        assert len(want[i].token_ids) == at + 1 and want[i].finish_reason in ("stop_sequence", "length"), i


def test_max_batch_default_is_the_devices():
    # On a CPU a step's cost grows with its rows: there drafting stops at a smaller batch.
    config = EngineConfig(speculate=SPECULATE)
    assert with_device_defaults(config, "cpu").speculate_max_batch == SPECULATE_MAX_BATCH["cpu"] == 8
    assert with_device_defaults(config, "cuda").speculate_max_batch == SPECULATE_MAX_BATCH["cuda"] == 32
    assert with_device_defaults(dataclasses.replace(config, speculate_max_batch=2), "cpu").speculate_max_batch == 2
    assert config.speculate_max_batch is None      # the caller's config is left as it was
