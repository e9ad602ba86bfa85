"""Log-probabilities under the raw logits (before the grammar, the penalties and temperature): per
sampled row the chosen token's and its most likely alternatives, gathered on the device and read as
lists on the host; and a prompt's, token by token (``prompt_logprobs``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmserve.worker.sampling.transfer import on, row_indices

if TYPE_CHECKING:
    from llmserve.worker.sampling.state import RequestState


def compute_raw_logprobs(logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor | None:
    """log_softmax of the rows that asked for logprobs ([n_asking, vocab]), or None."""
    asking = [s.wants_logprobs for s in states]
    if not any(asking):
        return None
    if all(asking):
        return torch.log_softmax(logits, dim=-1)
    return torch.log_softmax(logits[row_indices(asking, logits.device)], dim=-1)


def gather_logprobs(
    raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor, states: list[RequestState]
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """On the device, for the rows that asked for logprobs: the chosen token's raw logprob and
    the most likely alternatives (as many as the greediest row wants); and those rows."""
    if raw_logprobs is None:
        return {}, []
    rows = [i for i, s in enumerate(states) if s.wants_logprobs]
    chosen_ids = token_ids if len(rows) == len(states) else token_ids[on(rows, token_ids.device)]
    chosen = raw_logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    top_values, top_ids = _topk(raw_logprobs, max(states[i].params.logprobs for i in rows))
    return {"chosen": chosen, "top_values": top_values, "top_ids": top_ids}, rows


def logprob_lists(
    host: dict[str, torch.Tensor], rows: list[int], states: list[RequestState]
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Per request: the chosen token's raw logprob and its top alternatives, or None."""
    logprobs: list[float | None] = [None] * len(states)
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * len(states)
    if not rows:
        return logprobs, top_logprobs
    chosen = host["chosen"].tolist()
    top = _pairs(host["top_values"], host["top_ids"])
    for n, row in enumerate(rows):
        logprobs[row] = chosen[n]
        top_logprobs[row] = top[n][: states[row].params.logprobs]
    return logprobs, top_logprobs


def _topk(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logprobs``, its k largest values and their token ids, largest first."""
    # More alternatives than the vocabulary has would make topk raise; 0 gives empty rows.
    return logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)


def _pairs(values: torch.Tensor, token_ids: torch.Tensor) -> list[list[tuple[int, float]]]:
    """``_topk``'s rows as lists of (token id, logprob) pairs."""
    return [list(zip(ids, vals)) for ids, vals in zip(token_ids.tolist(), values.tolist())]


def prompt_logprobs(
    logits: torch.Tensor, prompt_token_ids: list[int], num_top: int
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Each prompt token's logprob given the tokens before it, and the ``num_top`` most likely
    tokens at its position; None for the first token, which has nothing before it.

    ``logits`` has one row per prompt position ([len(prompt), vocab]): row j predicts token j + 1.
    """
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    next_ids = torch.tensor(prompt_token_ids[1:], dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
    return [None, *chosen], [None, *_pairs(*_topk(logprobs, num_top))]
