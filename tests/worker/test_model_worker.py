"""model_worker's choices made before a model exists (a CPU rank's threads), and when an
overlapped step that drafts waits for the step before it, on an in-process rank 0 driven step by
step as the engine would (the engine's tests hold speculation's tokens equal to plain decoding's)."""

from __future__ import annotations

import os

import pytest
from transformers import LlamaConfig

from llmserve.sampling_params import SamplingParams
from llmserve.worker.model_worker import ModelWorker, cpu_threads
from llmserve.worker.prompt_lookup import PromptLookup
from llmserve.worker.protocol import BatchEntry, StepInput, WorkerInitArgs
from parity_utils import build_tiny_hf_model

# A vocabulary small enough that the prompt holds every token: whatever the model draws, the
# n-gram index finds it earlier, so every budget below gets a draft.
VOCAB = 64
PROMPT = list(range(VOCAB))
BUDGET = 3


def test_cpu_threads_are_the_operators_where_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(ranks_per_node=2) == 3


@pytest.mark.parametrize("value", [None, "", "0", "two"])
def test_cpu_threads_else_split_the_allowed_cores_between_the_ranks(monkeypatch: pytest.MonkeyPatch, value) -> None:
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))     # 6 of the machine's cores
    assert cpu_threads(ranks_per_node=1) == 6
    assert cpu_threads(ranks_per_node=4) == 1
    assert cpu_threads(ranks_per_node=8) == 1     # never none


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> ModelWorker:
    """Rank 0 of a tiny random Llama over VOCAB tokens, in this process, with speculation on."""
    path = tmp_path_factory.mktemp("llama-small-vocab")
    build_tiny_hf_model(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512), path)
    return ModelWorker(WorkerInitArgs(model_path=str(path), model_type="llama", rank=0, world_size=1, device="cpu",
                                      max_total_token_num=512, max_running_requests=4, speculate=BUDGET))


def test_a_draft_past_a_token_in_flight_is_launched_before_that_token_is_read(worker, monkeypatch):
    """Overlapped steps of one greedy request, each decode's last token in flight: the engine
    cannot know it, nor how much of a draft was kept. Rank 0 reads the step before first (the
    read waits for the device) only for the request's first output token, or after a verify (the
    request's position); otherwise it queues the forward first, feeding the token in flight and
    then the draft past its index's guess for that token."""
    events: list = []              # "read" (of a launched step) and ("forward", its input ids), in order
    read, forward = worker._read, worker.model.forward

    def recording_read(launched):
        if launched is not None:
            events.append("read")
        return read(launched)

    def recording_forward(input_ids, *args, **kwargs):
        events.append(("forward", input_ids.tolist()))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(worker, "_read", recording_read)
    monkeypatch.setattr(worker.model, "forward", recording_forward)
    seq = list(PROMPT)             # the request's tokens read so far

    def step(draft_budget: int) -> tuple[list, int]:
        """A decode of the request, its last token in flight; the events, and the token in flight
        (now read)."""
        events.clear()
        [owed] = worker.step(StepInput([BatchEntry(1, [], len(seq), pending_token=True, draft_budget=draft_budget)],
                                       overlap=True))
        seq.extend(owed.run_of(0).token_ids)
        return list(events), owed.run_of(0).token_ids[-1]

    params = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    assert worker.step(StepInput([BatchEntry(1, list(PROMPT), 0, params=params, prompt_token_ids=list(PROMPT))],
                                 overlap=True)) == []
    # The first output token: waited for (a guess from the prompt alone is seldom right).
    events_, first = step(BUDGET)
    draft = PromptLookup(seq).propose(BUDGET).token_ids
    assert events_ == ["read", ("forward", [first, *draft])] and draft
    events_, token = step(0)       # after the verify: read first
    assert events_ == ["read", ("forward", [token])]
    # The token in flight is the plain decode's draw: the draft follows the index's guess for it.
    draft = PromptLookup(seq).propose(BUDGET, num_pending=1).token_ids
    events_, token = step(BUDGET)
    assert events_ == [("forward", [token, *draft]), "read"] and draft
    events_, token = step(BUDGET)  # after the verify: read first, then a draft past the known token
    assert events_[0] == "read" and events_[1][1][0] == token and len(events_) == 2
    [_] = worker.step(StepInput([], finished_req_ids=[1]))
    assert not worker.req_rows and not worker.lookups
