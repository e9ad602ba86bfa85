"""One sampling step over a batch (``sample_batch``), and its draw on the way to the host
(``PendingSample``, read as a ``SampleResult``). The pipeline per step:

1. log-probabilities of the raw logits, if some request asked for them;
2. constrained requests (``guided_decoding``): every token their grammar does not allow next
   masked out (llguidance's bitmask, computed on the host for those rows only);
3. EOS and stop token ids masked out for requests still short of their ``min_tokens``;
4. repetition / presence / frequency penalties (one kernel call for the whole batch);
5. greedy rows: argmax;
6. other rows: temperature, then top-k, then top-p, then typical-p (HF's warper order),
   then a random draw.

A constrained request's matcher takes each drawn token when the draw is read
(``PendingSample.result``); the worker reads step N's draw after it has queued step N+1's
forward, so the host computes step N+1's masks while the device runs that forward. A batch
without constrained requests skips step 2 at the cost of one attribute test per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmserve.worker.sampling.logprobs import compute_raw_logprobs, gather_logprobs, logprob_lists
from llmserve.worker.sampling.processors import (
    advance_matcher, apply_grammar, apply_penalties, ban_stop_tokens_below_min_tokens,
)
from llmserve.worker.sampling.transfer import copy_to_host
from llmserve.worker.sampling.warp import choose_tokens

if TYPE_CHECKING:
    from llmserve.worker.sampling.state import RequestState


@dataclass
class SampleResult:
    # None where the row failed (see errors).
    token_ids: list[int | None]
    # log_softmax of the raw logits (before penalties and temperature) at the chosen
    # token; None for requests whose params.logprobs is None.
    logprobs: list[float | None]
    # The params.logprobs most likely tokens under the raw logits, as (token id, logprob)
    # pairs, most likely first; None for requests whose params.logprobs is None.
    top_logprobs: list[list[tuple[int, float]] | None]
    # Per row: None, or why this row got no token (the request must fail).
    errors: list[str | None]


class PendingSample:
    """One batch's draw, on its way from the device to the host.

    ``token_ids`` (on the device, one per row; 0 where the row failed) can feed the next
    step's forward before the host has read them; ``result()`` waits for the copies and
    returns the ``SampleResult``, counting the tokens into their requests' penalty state once."""

    def __init__(self, states: list[RequestState], token_ids: torch.Tensor, host: dict[str, torch.Tensor],
                 logprob_rows: list[int], ready: torch.cuda.Event | None):
        self.token_ids = token_ids
        self._states = states
        self._host = host                 # token ids, and the logprobs' tensors: copies under way
        self._logprob_rows = logprob_rows
        self._ready = ready               # recorded after the copies (None on the CPU: done already)
        self._result: SampleResult | None = None

    @classmethod
    def of(cls, result: SampleResult) -> PendingSample:
        """A draw that is already on the host (the row-by-row path)."""
        # A failed row's request ends once the engine reads this; until then, a step launched
        # ahead may feed its "token" to the forward, so it must be a valid id.
        pending = cls([], torch.tensor([0 if t is None else t for t in result.token_ids]), {}, [], None)
        pending._result = result
        return pending

    def result(self) -> SampleResult:
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            token_ids = self._host["token_ids"].tolist()
            errors: list[str | None] = [None] * len(token_ids)
            for row, (state, token_id) in enumerate(zip(self._states, token_ids)):
                state.token_counts[token_id] = state.token_counts.get(token_id, 0) + 1
                if state.matcher is not None:
                    errors[row] = advance_matcher(state.matcher, token_id)
            logprobs, top_logprobs = logprob_lists(self._host, self._logprob_rows, self._states)
            self._result = SampleResult(token_ids, logprobs, top_logprobs, errors)
        return self._result


def sample_batch(logits: torch.Tensor, states: list[RequestState]) -> PendingSample:
    """The pipeline over all rows at once (``logits`` is modified in place), queued on the
    device. The requests' state changes only once every step has been queued: the number
    sampled now, the token counts when the result is read."""
    raw_logprobs = compute_raw_logprobs(logits, states)  # before the penalties touch logits
    apply_grammar(logits, states)
    ban_stop_tokens_below_min_tokens(logits, states)
    apply_penalties(logits, states)
    token_ids = choose_tokens(logits, states)
    device_out, logprob_rows = gather_logprobs(raw_logprobs, token_ids, states)
    device_out["token_ids"] = token_ids
    host, ready = copy_to_host(device_out)
    for state in states:
        state.num_sampled += 1
    return PendingSample(states, token_ids, host, logprob_rows, ready)
