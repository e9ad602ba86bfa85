"""The ``Sampler``: the worker's per-request sampling state by request id, and the calls that
sample a batch (``launch`` / ``sample``) or verify its drafts (``verify``).

Drawing and reading are two calls (``Sampler.launch``, then ``PendingSample.result``), so that
on a GPU the host can queue the next step's forward before it waits for this step's tokens
(the worker's overlapped loop); ``Sampler.sample`` does both at once.

A request whose parameters break a step (say a top_k no tensor can hold) fails alone: the
batch is sampled again row by row from the same logits and random state, so every other row
gets exactly the token it would have got, and the culprit gets an error instead.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

import torch

from llmserve.sampling_params import SamplingParams
from llmserve.ipc import error_line
from llmserve.worker.sampling.pipeline import PendingSample, SampleResult, sample_batch
from llmserve.worker.sampling.state import RandomState, RequestState
from llmserve.worker.sampling.verify import VerifyResult, edits_logits, unfeed, verify_batch

if TYPE_CHECKING:
    from llmserve.grammar import GrammarCompiler


class Sampler:
    """Per-request sampling state, and the batched sampling step."""

    def __init__(self, eos_token_ids: Iterable[int] = (), grammar: GrammarCompiler | None = None) -> None:
        self._requests: dict[int, RequestState] = {}
        self._eos_token_ids = frozenset(eos_token_ids)
        self._grammar = grammar    # None: a constrained request fails at add_request

    def add_request(self, req_id: int, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        """Start tracking a request. Re-adding a known id keeps its state: a preempted
        request is prefilled again later, but its counts and random stream go on."""
        if req_id in self._requests:
            return
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        matcher = None
        if params.guided_decoding is not None:
            if self._grammar is None:
                raise ValueError("this sampler has no grammar compiler: guided_decoding is not available")
            matcher = self._grammar.matcher(params.guided_decoding)
        self._requests[req_id] = RequestState(
            params=params,
            token_counts=dict.fromkeys(prompt_token_ids, 0),
            # torch seeds are unsigned 64-bit; fold any Python int into that range.
            seed=seed % 2**64,
            min_tokens_banned=sorted(self._eos_token_ids | set(params.stop_token_ids)),
            matcher=matcher,
        )

    def remove_request(self, req_id: int) -> None:
        self._requests.pop(req_id, None)

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._requests

    def sample(self, logits: torch.Tensor, req_ids: list[int]) -> SampleResult:
        """Pick one token per row of ``logits`` ([batch, vocab] float32, left as it is).

        A row that cannot be sampled gets an error in ``errors`` and no token; the others are
        sampled exactly as if it had not been in the batch."""
        return self.launch(logits, req_ids).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, req_ids: list[int]) -> PendingSample:
        """``sample``'s draw, queued on the logits' device; ``result()`` reads it. The requests'
        token counts (the penalties') take the tokens only then: read a step's result before
        launching the next step of the same requests."""
        states = [self._requests[req_id] for req_id in req_ids]
        saved = [RandomState.save(s) for s in states]
        try:
            # On a copy, so a failed attempt leaves the rows as the forward made them for the
            # retry (the copy is small beside the lm_head matmul that made the logits).
            return sample_batch(logits.clone(), states)
        except Exception:
            for snapshot in saved:
                snapshot.restore()
        return PendingSample.of(self._sample_row_by_row(logits, states))

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, req_ids: list[int], draft_token_ids: list[list[int]]) -> VerifyResult:
        """Check each request's draft against the model and emit the tokens it keeps, plus one.

        ``logits``: for request i, ``1 + len(draft_token_ids[i])`` consecutive rows, requests back
        to back; row j of request i holds the logits after feeding draft token j - 1 (row 0:
        after the request's last token). Row j is processed as ``sample`` would process it had
        draft tokens 0..j-1 been emitted (grammar, min_tokens, penalties counting them). Greedy
        requests keep the longest draft prefix equal to the argmax, then the argmax of the next
        row: token for token what ``sample`` gives step by step. Sampling requests keep draft
        token t at row j with probability p_j(t); at the first rejection the next token is drawn
        from p_j with t removed, after a full acceptance from the last row (speculative sampling
        with a one-hot draft), so the tokens are distributed exactly as ``sample``'s are. A
        request with an empty draft is an ordinary one-token sample (the very token ``sample``
        would draw). Each request's state advances by exactly the emitted tokens. Synchronous.
        """
        if len(draft_token_ids) != len(req_ids):
            raise ValueError(f"verify: {len(draft_token_ids)} drafts for {len(req_ids)} requests")
        states = [self._requests[req_id] for req_id in req_ids]
        saved = [RandomState.save(s) for s in states]
        fed = [0] * len(states)
        try:
            # On a copy where the processing writes to the rows, as launch; a greedy or plainly
            # sampled batch only reads them, and its rows are (1 + draft) times a step's.
            return verify_batch(logits.clone() if edits_logits(states) else logits, states, draft_token_ids, fed)
        except Exception:
            for snapshot in saved:
                snapshot.restore()
            unfeed(states, fed)
        return self._verify_one_by_one(logits, states, draft_token_ids)

    @staticmethod
    def _verify_one_by_one(logits: torch.Tensor, states: list[RequestState],
                           draft_token_ids: list[list[int]]) -> VerifyResult:
        """The slow path after a failed batch: each request alone, its failure its own."""
        starts = [0]
        for draft in draft_token_ids:
            starts.append(starts[-1] + 1 + len(draft))

        def one(i: int) -> VerifyResult:
            saved, fed = RandomState.save(states[i]), [0]
            try:
                return verify_batch(logits[starts[i] : starts[i + 1]].clone(), [states[i]], [draft_token_ids[i]], fed)
            except Exception:
                saved.restore()
                unfeed([states[i]], fed)
                raise

        return _each_alone(VerifyResult([], [], [], []), len(states), one, no_tokens=list)

    @staticmethod
    def _sample_row_by_row(logits: torch.Tensor, states: list[RequestState]) -> SampleResult:
        """The slow path after a failed batch: each row alone, its failure its own."""
        def one(row: int) -> SampleResult:
            return sample_batch(logits[row : row + 1].clone(), [states[row]]).result()

        return _each_alone(SampleResult([], [], [], []), len(states), one, no_tokens=lambda: None)


_Result = TypeVar("_Result", SampleResult, VerifyResult)


def _each_alone(result: _Result, num: int, one: Callable[[int], _Result],
                no_tokens: Callable[[], list[int] | None]) -> _Result:
    """Fill ``result`` (empty) with ``one(i)``'s one-request answer for each i < num, or, where it raises,
    ``no_tokens()`` and the error: the slow path after a failed batch, each failure its own."""
    for i in range(num):
        try:
            alone = one(i)
            tokens, logprobs, top, error = alone.token_ids[0], alone.logprobs[0], alone.top_logprobs[0], alone.errors[0]
        except Exception as e:
            tokens, logprobs, top, error = no_tokens(), None, None, error_line(e)
        result.token_ids.append(tokens)
        result.logprobs.append(logprobs)
        result.top_logprobs.append(top)
        result.errors.append(error)
    return result
