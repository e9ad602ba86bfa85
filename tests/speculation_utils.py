"""Prompt-lookup speculation's test helpers: tests/engine's test_speculation.py (tiny random
models) and test_speculation_grounded.py (the embedded model) compare a speculating run with the
same engine's plain one (``SamplingParams.speculate=False``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.engine import LLMEngine

SPECULATE = 10
# Every test batches drafting requests: above the CPU's default (1) they would draft nothing.
MAX_BATCH = 32


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
