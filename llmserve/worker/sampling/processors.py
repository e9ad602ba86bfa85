"""The pipeline's edits of the logits in place, before a token is chosen, each skipped by a batch
that has no use for it:

- constrained requests (``guided_decoding``): every token their grammar does not allow next masked
  out (llguidance's bitmask, computed on the host for those rows only); ``advance_matcher`` feeds
  the matcher the token drawn;
- EOS and stop token ids masked out for requests still short of their ``min_tokens``;
- repetition / presence / frequency penalties (one kernel call for the whole batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmserve.kernels import apply_penalty
from llmserve.worker.sampling.transfer import columns_on, on

if TYPE_CHECKING:
    import llguidance

    from llmserve.worker.sampling.state import RequestState


def apply_grammar(logits: torch.Tensor, states: list[RequestState]) -> None:
    """Mask to -inf, in place, every token a constrained row's grammar does not allow next."""
    rows = [i for i, s in enumerate(states) if s.matcher is not None]
    if not rows:
        return
    words = _grammar_bitmask([states[i].matcher for i in rows], mask_words(logits.shape[-1]))
    mask_disallowed(logits, rows, words)


def mask_words(vocab_size: int) -> int:
    """How many int32 words a bitmask over ``vocab_size`` tokens takes."""
    return (vocab_size + 31) // 32


def mask_disallowed(logits: torch.Tensor, rows: list[int], words) -> None:
    """Mask to -inf, in place, in each of ``rows``, the tokens its bitmask (a row of ``words``,
    [len(rows), num_words] int32, numpy) does not allow."""
    vocab_size = logits.shape[-1]
    # Bit b of word w allows token 32 w + b (llguidance's layout, little-endian words).
    if logits.is_cuda:
        # 1/32 of the bytes cross to the device; unpacked there.
        bits = torch.from_numpy(words).to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab_size].bool()
    else:
        # numpy unpacks in one pass, where torch's elementwise ops would take several.
        import numpy as np

        unpacked = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        allowed = torch.from_numpy(np.ascontiguousarray(unpacked)).view(torch.bool)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = on(rows, logits.device, torch.long)
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))


def _grammar_bitmask(matchers: list[llguidance.LLMatcher], num_words: int):
    """The matchers' next-token bitmasks ([n, num_words] int32, numpy), computed by llguidance's
    thread pool when there are many (it releases the GIL). A mask takes ~15 us at the median, so
    a few are cheaper one after the other than a wake-up of the pool (on a busy 2-core host, up
    to tens of ms)."""
    import numpy as np

    words = np.zeros((len(matchers), num_words), dtype=np.int32)
    if len(matchers) < PARALLEL_MASKS:
        for row, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(words[row].ctypes.data, words[row].nbytes)
    else:
        _mask_executor().unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], words.ctypes.data, num_words * 4, len(matchers))
    return words


# From this many constrained rows in a batch on, their masks are computed in parallel.
PARALLEL_MASKS = 8
_executor = None


def _mask_executor():
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


def advance_matcher(matcher: llguidance.LLMatcher, token_id: int) -> str | None:
    """Feed the drawn token to the request's matcher; why the request must fail, or None.

    The mask keeps a drawn token inside the grammar, so a refusal means no token was allowed
    (say, EOS banned by min_tokens where the grammar allowed nothing else)."""
    if matcher.consume_token(token_id):
        return None
    return f"GrammarError: token {token_id} is outside the guided_decoding grammar: {matcher.get_error()}"


def ban_stop_tokens_below_min_tokens(logits: torch.Tensor, states: list[RequestState]) -> None:
    """Mask to -inf, in place, the EOS and stop ids of requests short of their min_tokens
    (vLLM's rule, whatever ignore_eos says). Ids outside the vocabulary are skipped."""
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for row, state in enumerate(states):
        if state.below_min_tokens:
            banned = [t for t in state.min_tokens_banned if 0 <= t < vocab_size]
            rows += [row] * len(banned)
            cols += banned
    if rows:
        row_index, col_index = columns_on(logits.device, (rows, torch.long), (cols, torch.long))
        logits[row_index, col_index] = float("-inf")


def apply_penalties(logits: torch.Tensor, states: list[RequestState]) -> None:
    """Penalise, in place, the tokens each request has already seen.

    Rows without penalties get an empty token list, so the kernel leaves them alone.
    """
    if not any(s.has_penalties for s in states):
        return
    import numpy as np

    # numpy arrays from each row's dict, not one list of every row's tokens: a 1000-token context
    # over a verify's 352 rows makes 360k entries, which torch.tensor converts 4x slower than
    # np.fromiter (and extending lists costs as much again).
    token_ids: list = []
    token_counts: list = []
    cumsum_seq_len = [0]
    for state in states:
        if state.has_penalties:
            num = len(state.token_counts)
            token_ids.append(np.fromiter(state.token_counts.keys(), dtype=np.int32, count=num))
            token_counts.append(np.fromiter(state.token_counts.values(), dtype=np.int32, count=num))
        cumsum_seq_len.append(cumsum_seq_len[-1] + (len(state.token_counts) if state.has_penalties else 0))
    max_len_in_batch = max(b - a for a, b in zip(cumsum_seq_len, cumsum_seq_len[1:]))
    columns = columns_on(
        logits.device,
        ([s.params.presence_penalty for s in states], torch.float32),
        ([s.params.frequency_penalty for s in states], torch.float32),
        ([s.params.repetition_penalty for s in states], torch.float32),
        (np.concatenate(token_ids), torch.int32),
        (np.concatenate(token_counts), torch.int32),
        (cumsum_seq_len, torch.int32),
    )
    apply_penalty(logits, *columns, max_len_in_batch)
