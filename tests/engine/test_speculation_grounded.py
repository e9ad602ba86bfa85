"""Prompt-lookup speculation on the embedded model's input-grounded prompts, whose answers copy
from them: drafts are accepted, mixed with a request that does not draft, and the output is the
plain run's; then with stop ids, stop strings and max_new_tokens falling inside accepted runs,
under a KV cache small enough to preempt, chunked prefill, and the overlapped loop
(test_speculation.py holds the same on tiny random models of each architecture)."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.drafting import DraftCost
from llmserve.engine.engine import LLMEngine
from speculation_utils import (MAX_BATCH, SPECULATE, assert_all_overlapped, assert_same_tokens, generate_counting,
                               overlapped, plain)


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
