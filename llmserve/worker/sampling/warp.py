"""Choosing one token per row from the processed logits: argmax for greedy rows; for the others
temperature, then top-k, then top-p, then typical-p (HF's warper order), then a random draw.

Everything is vectorised over the batch except the random draw: each request draws its
noise from its own ``torch.Generator``, so a seeded request produces the same tokens
whatever other requests share its batch, and wherever it sits in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmserve.worker.sampling.transfer import columns_on, row_indices

if TYPE_CHECKING:
    from llmserve.worker.sampling.state import RequestState


def choose_tokens(logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
    """One token id per row: argmax for greedy rows, a random draw for the others."""
    if all(s.is_greedy for s in states):
        return logits.argmax(dim=-1)
    token_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
    greedy_rows = row_indices([s.is_greedy for s in states], logits.device)
    random_rows = row_indices([not s.is_greedy for s in states], logits.device)
    if len(greedy_rows):
        token_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
    if len(random_rows):
        random_states = [s for s in states if not s.is_greedy]
        token_ids[random_rows] = _sample_random(logits[random_rows], random_states)
    return token_ids


def _sample_random(logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
    """Warp, then draw from what is left ([n, vocab] -> [n])."""
    probs = torch.softmax(warp(logits, states), dim=-1)
    return _draw(probs, states)


def warp(logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
    """Temperature, top-k, top-p, typical-p: the order of HF's ``_get_logits_processor``.
    Returns new logits with the excluded tokens at -inf."""
    cuts = any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in states)
    typical = any(s.params.typical_p < 1.0 for s in states)
    # The columns that apply, sent in one copy.
    columns = [([s.params.temperature for s in states], torch.float32)]
    if cuts:
        columns += [([s.params.top_k for s in states], torch.long), ([s.params.top_p for s in states], torch.float32)]
    if typical:
        columns.append(([s.params.typical_p for s in states], torch.float32))
    temperatures, *rest = columns_on(logits.device, *columns)
    logits = logits / temperatures.unsqueeze(1)
    if cuts:
        top_k, top_p, *rest = rest
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    if typical:
        logits = _apply_typical_p(logits, rest[0])
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, then outside its top-p nucleus.

    ``top_k == 0`` and ``top_p == 1`` mean no cut. Top-p follows HF: keep the smallest set
    of most likely tokens whose probability (after top-k) adds up to at least top_p, so
    the most likely token always stays.
    """
    if not logits.is_cuda and logits.shape[-1] > 2 * TOP_CANDIDATES:
        return _top_k_top_p_among_largest(logits, top_k, top_p)
    return _sort_top_k_top_p(logits, top_k, top_p)


def _sort_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``_apply_top_k_top_p`` by a sort of whole rows."""
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_token_ids = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab_size, device=logits.device).unsqueeze(0)

    top_k = torch.where(top_k > 0, top_k, vocab_size).unsqueeze(1)
    outside_top_k = rank >= top_k
    sorted_logits = sorted_logits.masked_fill(outside_top_k, float("-inf"))

    # A token is in the nucleus if the tokens more likely than it add up to < top_p.
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    prob_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # (Rows with top_p == 1 are skipped explicitly: rounding can push the cumulative sum
    # to 1.0 before the tail of tiny probabilities, which would then be cut.)
    outside_top_p = (prob_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)

    remove_sorted = outside_top_k | outside_top_p
    remove = torch.empty_like(remove_sorted).scatter_(-1, sorted_token_ids, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


# On the CPU, top-k / top-p first look among this many largest logits per row: sorting a whole
# vocabulary is what costs there (2 s for 352 rows of 49152, where topk of 1024 takes 0.17 s). On
# a GPU the sort is cheap, and finding the rows whose cut lies further would wait for the device.
TOP_CANDIDATES = 1024


def _top_k_top_p_among_largest(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``_apply_top_k_top_p``'s cut found among each row's TOP_CANDIDATES largest logits; the rows
    whose cut may fall past them (a top-k larger than that and no top-p, or a nucleus wider than
    them) take the whole sort."""
    vocab_size, num = logits.shape[-1], TOP_CANDIDATES
    values, token_ids = logits.topk(num, dim=-1)
    rank = torch.arange(num, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab_size).unsqueeze(1)
    within_k = k <= num
    values = values.masked_fill(rank >= k, float("-inf"))
    # Probabilities over the row after top-k: its mass lies among the candidates where top-k
    # does, else over the whole row where there is no top-k (a top-k between the two: sorted).
    normaliser = values.logsumexp(dim=-1, keepdim=True)
    if not bool(within_k.all()):   # (this runs on the CPU: no device to wait for)
        normaliser = torch.where(within_k, normaliser, logits.logsumexp(dim=-1, keepdim=True))
    probs = (values - normaliser).exp()
    cumulative = torch.cumsum(probs, dim=-1)
    has_top_p = (top_p < 1.0).unsqueeze(1)
    outside_top_p = (cumulative - probs >= top_p.unsqueeze(1)) & has_top_p
    uncut = (k >= vocab_size) & ~has_top_p    # rows of the batch without a cut of their own: all kept
    allowed = uncut.expand_as(logits).clone().scatter_(-1, token_ids, ~(outside_top_p | (rank >= k)))
    cut = logits.masked_fill(~allowed, float("-inf"))
    # The cut is among the candidates where top-k makes it there, or the nucleus ends there.
    nucleus_within = has_top_p & (k >= vocab_size) & (cumulative[:, -1:] >= top_p.unsqueeze(1))
    further = ~(uncut | within_k | nucleus_within).squeeze(1)
    if further.any():
        rows = further.nonzero().squeeze(1)
        cut[rows] = _sort_top_k_top_p(logits[rows], top_k[rows], top_p[rows])
    return cut


def _apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling, as HF's TypicalLogitsWarper: rank tokens by how far their
    surprise (-log p) is from the row's entropy, and keep the smallest such prefix whose
    probability reaches typical_p (ties with its last token included; the first always stays).

    ``typical_p == 1`` rows are left alone. Tokens already at -inf (cut by top-k / top-p) have
    an infinite distance, so they sort last and stay cut.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    # nansum: 0 * -inf is NaN for the tokens already cut, which contribute nothing.
    entropy = -(logprobs * logprobs.exp()).nansum(dim=-1, keepdim=True)
    distance = (-logprobs - entropy).abs()
    sorted_distance, sorted_token_ids = distance.sort(dim=-1)
    # Probabilities from the sorted logits, as HF computes them, so that the cut falls at
    # exactly the same token when the cumulative sum lands near typical_p.
    cumulative = logits.gather(-1, sorted_token_ids).softmax(dim=-1).cumsum(dim=-1)
    last_kept = (cumulative < typical_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(max=logits.shape[-1] - 1)
    threshold = sorted_distance.gather(-1, last_kept)
    remove = (distance > threshold) & (typical_p < 1.0).unsqueeze(1)
    return logits.masked_fill(remove, float("-inf"))


def _draw(probs: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
    """Sample one token per row of ``probs`` with each row's own generator.

    argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with probability p_i (the
    exponential race, equivalent to the Gumbel-max trick), needs no cumulative sum, and
    lets every row take its noise from its own generator.
    """
    noise = exponential_noise([s.generator_on(probs.device) for s in states], probs.shape[-1], probs.device,
                               probs.dtype)
    return (probs / noise).argmax(dim=-1)


def exponential_noise(generators: list[torch.Generator | None], vocab_size: int, device: torch.device,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The exponential race's noise (``_draw``): per generator a row of Exp(1) draws from it, ones
    where it is None (a row that draws nothing); [len(generators), vocab_size]."""
    fill = torch.empty if all(g is not None for g in generators) else torch.ones
    noise = fill(len(generators), vocab_size, device=device, dtype=dtype)
    for row, generator in enumerate(generators):
        if generator is not None:
            # Row by row in place: torch.stack of separate rows costs ~5x more on the CPU.
            noise[row].exponential_(generator=generator)
    # q == 0 would turn a masked token's 0 / 0 into NaN, and argmax picks NaN.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
