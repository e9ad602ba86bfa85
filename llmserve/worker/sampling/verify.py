"""Speculative decoding (prompt lookup): checking drafts with ``Sampler.verify``.

A request with k draft tokens brings k + 1 rows of logits, and row j goes through the pipeline
(pipeline.py) as if draft tokens 0..j-1 had been emitted (its matcher fed them, min_tokens and the
penalties count them). Greedy rows keep the draft while it is the argmax; sampling rows keep draft
token t with probability p(t) and, at the first rejection, draw from p without t (speculative
sampling with a one-hot draft: the tokens come out as ``sample`` would draw them). All rows at
once, one read of the device: an all-greedy batch reads every row's argmax and finds the accepted
runs on the host; a batch with sampling requests decides on the device (its last draws need the
runs there), its per-row host columns sent in one copy. On a GPU these steps cost launches and
transfers, not arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from llmserve.worker.sampling.logprobs import compute_raw_logprobs, gather_logprobs, logprob_lists
from llmserve.worker.sampling.processors import (
    advance_matcher, apply_penalties, ban_stop_tokens_below_min_tokens, mask_disallowed, mask_words,
)
from llmserve.worker.sampling.transfer import columns_on, read_to_host
from llmserve.worker.sampling.warp import exponential_noise, warp

if TYPE_CHECKING:
    from llmserve.worker.sampling.state import RequestState


@dataclass
class VerifyResult:
    """``Sampler.verify``'s answer, per request of the batch."""
    # The accepted prefix of the draft, then one more token (at least one token), or [] where
    # the request failed (see errors).
    token_ids: list[list[int]]
    # Per emitted token, as SampleResult has them (raw logits); None unless params.logprobs.
    logprobs: list[list[float] | None]
    top_logprobs: list[list[list[tuple[int, float]]] | None]
    # Per request: None, or why it must fail (its grammar refused a token, or its parameters
    # broke the step: then it has no tokens).
    errors: list[str | None] = field(default_factory=list)


def verify_batch(logits: torch.Tensor, states: list[RequestState], drafts: list[list[int]],
                  fed: list[int]) -> VerifyResult:
    """``Sampler.verify`` over all requests at once (``logits`` is modified in place). ``fed[i]``
    counts the draft tokens request i's matcher has taken so far, so that a failure can undo them."""
    starts = [0]
    for draft in drafts:
        starts.append(starts[-1] + 1 + len(draft))
    if logits.shape[0] != starts[-1]:
        raise ValueError(f"verify: {logits.shape[0]} rows of logits for {starts[-1]} (1 + draft per request)")
    rows = [row for state, draft in zip(states, drafts) for row in _row_states(state, draft)]
    raw_logprobs = compute_raw_logprobs(logits, rows)  # before the penalties touch logits
    _apply_draft_grammar(logits, states, drafts, starts, fed)
    ban_stop_tokens_below_min_tokens(logits, rows)
    apply_penalties(logits, rows)
    if all(s.is_greedy for s in states):
        decided = _decide_greedy(logits, raw_logprobs, rows, drafts, starts)
    else:
        decided = _decide_on_device(logits, raw_logprobs, states, rows, drafts, starts)
    return _verify_result(decided, states, drafts, starts, fed)


@dataclass
class _Decided:
    """What verify decided, on the host: per request, how many draft tokens it keeps and the token
    after them; and the logprobs of the emitted rows (``gather_logprobs``' tensors, copied)."""
    num_accepted: list[int]
    next_ids: list[int]
    logprobs: dict[str, torch.Tensor]
    logprob_rows: list[int]


def _decide_greedy(logits: torch.Tensor, raw_logprobs: torch.Tensor | None, rows: list[RequestState],
                   drafts: list[list[int]], starts: list[int]) -> _Decided:
    """An all-greedy batch: the argmax of every row on the device, one read, the accepted runs on the
    host (a few hundred ints). ``_decide_on_device``'s rule for greedy rows: a draft token is kept
    where it is the argmax and the processing left it allowed (> -inf)."""
    best = logits.argmax(dim=-1)
    # Where the draft token is the argmax, it is banned exactly when the argmax is: a row whose
    # every token is banned (or NaN, which argmax picks and no comparison passes).
    allowed = logits.gather(1, best.unsqueeze(1)).squeeze(1) > float("-inf")
    # Every emitted row emits its argmax (an accepted draft token is one), so its logprob is there.
    device_out, logprob_rows = gather_logprobs(raw_logprobs, best, rows)
    host = read_to_host(device_out | {"best": best, "allowed": allowed})
    best_ids, allowed_rows = host["best"].tolist(), host["allowed"].tolist()
    num_accepted: list[int] = []
    for start, draft in zip(starts, drafts):
        n = 0
        while n < len(draft) and allowed_rows[start + n] and best_ids[start + n] == draft[n]:
            n += 1
        num_accepted.append(n)
    next_ids = [best_ids[start + n] for start, n in zip(starts, num_accepted)]
    return _Decided(num_accepted, next_ids, host, logprob_rows)


def _decide_on_device(logits: torch.Tensor, raw_logprobs: torch.Tensor | None, states: list[RequestState],
                      rows: list[RequestState], drafts: list[list[int]], starts: list[int]) -> _Decided:
    """A batch with sampling requests: every decision on the device (the last draw needs the accepted
    runs there), the host's per-row columns sent in one copy, the outcome read once."""
    device, vocab_size = logits.device, logits.shape[-1]
    greedy = [s.is_greedy for s in states]
    # The token each row checks: draft token j at row j; none (0, never accepted) at the last row.
    checked = [t for draft in drafts for t in (*draft, 0)]
    has_draft = [j < len(draft) for draft in drafts for j in range(len(draft) + 1)]
    # [requests, longest draft] row indices for the accepted runs; past a request's draft, a row
    # (one past the last) that is never accepted.
    max_draft = max(len(d) for d in drafts)
    run_rows = [starts[i] + j if j < len(d) else starts[-1] for i, d in enumerate(drafts) for j in range(max_draft)]
    random_rows = [r for r, state in enumerate(rows) if not state.is_greedy]
    checked_ids, checkable, greedy_row, run_index, first_rows, draft_lengths, random_request, random_index = columns_on(
        device,
        ([min(max(t, 0), vocab_size - 1) for t in checked], torch.long),
        # Rows with a draft token the vocabulary has (a draft is the request's own tokens, so
        # always, but an id past the logits must not stand for another).
        ([d and 0 <= t < vocab_size for d, t in zip(has_draft, checked)], torch.bool),
        ([g for g, draft in zip(greedy, drafts) for _ in range(len(draft) + 1)], torch.bool),
        (run_rows, torch.long),
        (starts[:-1], torch.long),
        ([len(d) for d in drafts], torch.long),
        ([not g for g in greedy], torch.bool),
        (random_rows, torch.long),
    )
    # A token the processing banned (grammar, min_tokens) is never accepted, even by an argmax
    # over a row where every token is banned.
    accepted = checkable & (logits.gather(1, checked_ids.unsqueeze(1)).squeeze(1) > float("-inf"))
    keeps = torch.zeros_like(accepted)
    best = None
    if any(greedy):
        best = logits.argmax(dim=-1)
        keeps |= greedy_row & (best == checked_ids)
    probs = _verify_probs(logits, rows, None if len(random_rows) == len(rows) else random_index)
    uniforms, noise = _verify_noise(states, drafts, vocab_size, device)
    keeps |= ~greedy_row & (uniforms < probs.gather(1, checked_ids.unsqueeze(1)).squeeze(1))
    accepted &= keeps

    # Per request, how many of its draft rows in a row, from the first, are accepted.
    run = torch.cat([accepted, accepted.new_zeros(1)])[run_index.view(len(drafts), max_draft)]
    num_accepted = run.long().cumprod(dim=1).sum(dim=1)
    last_rows = first_rows + num_accepted
    next_ids = torch.zeros(len(states), dtype=torch.long, device=device) if best is None else best[last_rows]
    # At a rejection (stopped short of the draft's end) the rejected token is removed; the
    # exponential race draws from what is left in proportion, so renormalising is implicit.
    last_probs = probs[last_rows]
    rejected = (num_accepted < draft_lengths) & checkable[last_rows]
    rejected_ids = checked_ids[last_rows].unsqueeze(1)
    last_probs.scatter_(1, rejected_ids, last_probs.gather(1, rejected_ids) * (~rejected).unsqueeze(1))
    drawn = (last_probs / noise).argmax(dim=-1)
    next_ids = torch.where(random_request, drawn, next_ids)

    emitted_ids = checked_ids.clone()
    emitted_ids[last_rows] = next_ids
    device_out, logprob_rows = gather_logprobs(raw_logprobs, emitted_ids, rows)
    host = read_to_host(device_out | {"num_accepted": num_accepted, "next_ids": next_ids})
    return _Decided(host["num_accepted"].tolist(), host["next_ids"].tolist(), host, logprob_rows)


def _verify_probs(logits: torch.Tensor, rows: list[RequestState], random_index: torch.Tensor | None) -> torch.Tensor:
    """The distribution ``sample`` draws from at each sampling row (warped); zeros at greedy rows.
    ``random_index``: the sampling rows, or None where every row samples."""
    if random_index is None:
        return torch.softmax(warp(logits, rows), dim=-1)
    probs = torch.zeros_like(logits)
    probs[random_index] = torch.softmax(warp(logits[random_index], [r for r in rows if not r.is_greedy]), dim=-1)
    return probs


def edits_logits(states: list[RequestState]) -> bool:
    """Whether processing these requests' rows writes to the logits: grammar masks, min_tokens
    bans, penalties (the warpers make new tensors)."""
    return any(s.matcher is not None or s.below_min_tokens or s.has_penalties for s in states)


def _row_states(state: RequestState, draft: list[int]) -> list[RequestState]:
    """The request's state at each of its rows, as ``sample`` would see it had the draft tokens before
    the row been emitted: counted by the penalties and towards min_tokens. Read only; they share the
    generator and matcher."""
    # Only the penalties' counts and min_tokens see the draft: a request with neither is its own
    # state at every row (a copy per row would cost more than the rest of a greedy verify on a GPU).
    if not (state.has_penalties or state.below_min_tokens):
        return [state] * (len(draft) + 1)
    rows = [state]
    token_counts = state.token_counts
    for j, token_id in enumerate(draft):
        if state.has_penalties:
            token_counts = dict(token_counts)
            token_counts[token_id] = token_counts.get(token_id, 0) + 1
        rows.append(replace(state, token_counts=token_counts, num_sampled=state.num_sampled + j + 1))
    return rows


def _apply_draft_grammar(logits: torch.Tensor, states: list[RequestState], drafts: list[list[int]],
                         starts: list[int], fed: list[int]) -> None:
    """Mask each constrained request's rows by its grammar, feeding its matcher the draft on the way
    (row j's mask is the one after draft tokens 0..j-1). The first draft token the grammar refuses
    ends the walk: it cannot be accepted, so the rows after it are never reached and stay unmasked.
    A matcher that has stopped (its grammar complete) takes no more tokens and allows only its
    end from then on, as ``sample`` would find it step after step."""
    import numpy as np

    constrained = [i for i, s in enumerate(states) if s.matcher is not None]
    if not constrained:
        return
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    masks: list = []
    for i in constrained:
        matcher, draft = states[i].matcher, drafts[i]
        for j in range(len(draft) + 1):
            if fed[i] == j:    # else the matcher stopped at an earlier row: its mask stands
                words = np.zeros(mask_words(vocab_size), dtype=np.int32)
                matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            rows.append(starts[i] + j)
            masks.append(words)
            if j == len(draft) or not _allows(words, draft[j], vocab_size):
                break
            if not matcher.is_stopped():
                if not matcher.consume_token(draft[j]):
                    raise RuntimeError(f"the grammar refused draft token {draft[j]} its mask allowed: "
                                       f"{matcher.get_error()}")
                fed[i] += 1
    mask_disallowed(logits, rows, np.stack(masks))


def _allows(words, token_id: int, vocab_size: int) -> bool:
    """Whether a bitmask (one row of int32 words, llguidance's layout) allows ``token_id``."""
    return 0 <= token_id < vocab_size and bool((int(words[token_id >> 5]) >> (token_id & 31)) & 1)


def unfeed(states: list[RequestState], fed: list[int]) -> None:
    """Take back the draft tokens a failed attempt fed the matchers."""
    for i, state in enumerate(states):
        if state.matcher is not None and fed[i]:
            state.matcher.rollback(fed[i])
        fed[i] = 0


def _verify_noise(states: list[RequestState], drafts: list[list[int]], vocab_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, a uniform that decides its draft token; per request, the exponential noise of its
    last draw (``exponential_noise``). Each sampling request takes them from its own generator,
    uniforms first, so a seeded request draws the same whatever its batch; greedy requests take
    none (ones)."""
    uniforms = torch.ones(sum(len(d) + 1 for d in drafts), device=device)
    start = 0
    for state, draft in zip(states, drafts):
        if not state.is_greedy:
            # The last row has no draft token to decide.
            uniforms[start : start + len(draft)].uniform_(generator=state.generator_on(device))
        start += len(draft) + 1
    generators = [None if s.is_greedy else s.generator_on(device) for s in states]
    return uniforms, exponential_noise(generators, vocab_size, device)


def _verify_result(decided: _Decided, states: list[RequestState], drafts: list[list[int]], starts: list[int],
                   fed: list[int]) -> VerifyResult:
    """The emitted tokens per request, counted into its state: the penalties' counts, min_tokens,
    and its matcher (rolled back to the accepted prefix, then fed the rest)."""
    rows = [state for state, draft in zip(states, drafts) for _ in range(len(draft) + 1)]
    row_logprobs, row_top_logprobs = logprob_lists(decided.logprobs, decided.logprob_rows, rows)
    result = VerifyResult([], [], [], [])
    for i, (state, draft) in enumerate(zip(states, drafts)):
        n = decided.num_accepted[i]
        token_ids = [*draft[:n], decided.next_ids[i]]
        error = None
        if state.matcher is not None:
            kept = min(n, fed[i])
            if fed[i] > kept:
                state.matcher.rollback(fed[i] - kept)
            fed[i] = kept
            for token_id in token_ids[kept:]:   # past a stop, or the last token
                error = error or advance_matcher(state.matcher, token_id)
        for token_id in token_ids:
            state.token_counts[token_id] = state.token_counts.get(token_id, 0) + 1
        state.num_sampled += len(token_ids)
        emitted_rows = range(starts[i], starts[i] + n + 1)
        result.token_ids.append(token_ids)
        result.logprobs.append([row_logprobs[r] for r in emitted_rows] if state.wants_logprobs else None)
        result.top_logprobs.append([row_top_logprobs[r] for r in emitted_rows] if state.wants_logprobs else None)
        result.errors.append(error)
    return result
