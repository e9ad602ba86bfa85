"""Choosing the next token of every request in a batch from the model's logits.

Runs in the model worker (rank 0), right after the forward pass. The pipeline per step:

1. log-probabilities of the raw logits, if some request asked for them;
2. repetition / presence / frequency penalties (one kernel call for the whole batch);
3. greedy rows: argmax;
4. other rows: temperature, then top-k, then top-p, then a random draw.

Everything is vectorised over the batch except the random draw: each request draws its
noise from its own ``torch.Generator``, so a seeded request produces the same tokens
whatever other requests share its batch, and wherever it sits in it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from llmserve.kernels import apply_penalty
from llmserve.sampling_params import SamplingParams

# Below this temperature, logits / temperature can overflow float32 and softmax returns
# NaN; such a request is sampled greedily instead (which is what T -> 0 tends to anyway).
_MIN_TEMPERATURE = 1e-5


@dataclass
class SampleResult:
    token_ids: list[int]
    # log_softmax of the raw logits (before penalties and temperature) at the chosen
    # token; None for requests whose params.logprobs is None.
    logprobs: list[float | None]
    # The params.logprobs most likely tokens under the raw logits, as (token id, logprob)
    # pairs, most likely first; None for requests whose params.logprobs is None.
    top_logprobs: list[list[tuple[int, float]] | None]


@dataclass
class _RequestState:
    params: SamplingParams
    # One entry per distinct token of prompt + output, mapped to how often it occurs in
    # the OUTPUT (0 for a token seen only in the prompt): exactly what the penalty kernel
    # wants, kept up to date at O(1) per sampled token.
    token_counts: dict[int, int]
    seed: int
    # Created on first use, because only then do we know the device of the logits.
    generator: torch.Generator | None = field(default=None)

    @property
    def is_greedy(self) -> bool:
        return self.params.is_greedy or self.params.temperature < _MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    def generator_on(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        return self.generator


class Sampler:
    """Per-request sampling state, and the batched sampling step."""

    def __init__(self) -> None:
        self._requests: dict[int, _RequestState] = {}

    def add_request(self, req_id: int, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        """Start tracking a request. Re-adding a known id keeps its state: a preempted
        request is prefilled again later, but its counts and random stream go on."""
        if req_id in self._requests:
            return
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._requests[req_id] = _RequestState(
            params=params,
            token_counts=dict.fromkeys(prompt_token_ids, 0),
            # torch seeds are unsigned 64-bit; fold any Python int into that range.
            seed=seed % 2**64,
        )

    def remove_request(self, req_id: int) -> None:
        self._requests.pop(req_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, req_ids: list[int]) -> SampleResult:
        """Pick one token per row of ``logits`` ([batch, vocab] float32, modified in place)."""
        states = [self._requests[req_id] for req_id in req_ids]
        raw_logprobs = _raw_logprobs(logits, states)  # before the penalties touch logits
        _apply_penalties(logits, states)
        token_ids = _choose_tokens(logits, states)

        token_id_list = token_ids.tolist()
        for state, token_id in zip(states, token_id_list):
            state.token_counts[token_id] = state.token_counts.get(token_id, 0) + 1

        logprobs, top_logprobs = _gather_logprobs(raw_logprobs, token_ids, states)
        return SampleResult(token_id_list, logprobs, top_logprobs)


# --------------------------------------------------------------------------------------
# Pipeline steps
# --------------------------------------------------------------------------------------


def _row_indices(selected: list[bool], device: torch.device) -> torch.Tensor:
    """The indices of the selected batch rows, as an index tensor."""
    indices = [i for i, is_selected in enumerate(selected) if is_selected]
    return torch.tensor(indices, dtype=torch.long, device=device)


def _raw_logprobs(logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor | None:
    """log_softmax of the rows that asked for logprobs ([n_asking, vocab]), or None."""
    if not any(s.wants_logprobs for s in states):
        return None
    rows = _row_indices([s.wants_logprobs for s in states], logits.device)
    return torch.log_softmax(logits[rows], dim=-1)


def _apply_penalties(logits: torch.Tensor, states: list[_RequestState]) -> None:
    """Penalise, in place, the tokens each request has already seen.

    Rows without penalties get an empty token list, so the kernel leaves them alone.
    """
    if not any(s.has_penalties for s in states):
        return
    token_ids: list[int] = []
    token_counts: list[int] = []
    cumsum_seq_len = [0]
    for state in states:
        if state.has_penalties:
            token_ids.extend(state.token_counts.keys())
            token_counts.extend(state.token_counts.values())
        cumsum_seq_len.append(len(token_ids))
    max_len_in_batch = max(b - a for a, b in zip(cumsum_seq_len, cumsum_seq_len[1:]))

    def column(values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=logits.device)

    apply_penalty(
        logits,
        column([s.params.presence_penalty for s in states], torch.float32),
        column([s.params.frequency_penalty for s in states], torch.float32),
        column([s.params.repetition_penalty for s in states], torch.float32),
        column(token_ids, torch.int32),
        column(token_counts, torch.int32),
        column(cumsum_seq_len, torch.int32),
        max_len_in_batch,
    )


def _choose_tokens(logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
    """One token id per row: argmax for greedy rows, a random draw for the others."""
    token_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
    greedy_rows = _row_indices([s.is_greedy for s in states], logits.device)
    random_rows = _row_indices([not s.is_greedy for s in states], logits.device)
    if len(greedy_rows):
        token_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
    if len(random_rows):
        random_states = [s for s in states if not s.is_greedy]
        token_ids[random_rows] = _sample_random(logits[random_rows], random_states)
    return token_ids


def _sample_random(logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
    """Temperature, top-k, top-p, then a draw from what is left ([n, vocab] -> [n])."""
    device = logits.device
    temperatures = torch.tensor([s.params.temperature for s in states], device=device)
    logits = logits / temperatures.unsqueeze(1)
    if any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in states):
        top_k = torch.tensor([s.params.top_k for s in states], device=device)
        top_p = torch.tensor([s.params.top_p for s in states], device=device)
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return _draw(probs, states)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, then outside its top-p nucleus.

    ``top_k == 0`` and ``top_p == 1`` mean no cut. Top-p follows HF: keep the smallest set
    of most likely tokens whose probability (after top-k) adds up to at least top_p, so
    the most likely token always stays.
    """
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


def _draw(probs: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
    """Sample one token per row of ``probs`` with each row's own generator.

    argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with probability p_i (the
    exponential race, equivalent to the Gumbel-max trick), needs no cumulative sum, and
    lets every row take its noise from its own generator.
    """
    vocab_size = probs.shape[-1]
    noise = torch.stack([
        torch.empty(vocab_size, device=probs.device).exponential_(generator=s.generator_on(probs.device))
        for s in states
    ])
    # q == 0 would turn a masked token's 0 / 0 into NaN, and argmax picks NaN.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _gather_logprobs(
    raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor, states: list[_RequestState]
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Per request: the chosen token's raw logprob and the top alternatives, or None."""
    logprobs: list[float | None] = [None] * len(states)
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * len(states)
    if raw_logprobs is None:
        return logprobs, top_logprobs

    rows = [i for i, s in enumerate(states) if s.wants_logprobs]
    chosen_ids = token_ids[torch.tensor(rows, device=token_ids.device)]
    chosen = raw_logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()

    # More alternatives than the vocabulary has would make topk raise; 0 gives empty lists.
    max_k = min(max(states[i].params.logprobs for i in rows), raw_logprobs.shape[-1])
    top_values, top_ids = raw_logprobs.topk(max_k, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()

    for n, row in enumerate(rows):
        k = states[row].params.logprobs
        logprobs[row] = chosen[n]
        top_logprobs[row] = list(zip(top_ids[n][:k], top_values[n][:k]))
    return logprobs, top_logprobs
