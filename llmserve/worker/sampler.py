"""Choosing the next token of every request in a batch from the model's logits.

Runs in the model worker (rank 0), right after the forward pass. The pipeline per step:

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

Everything is vectorised over the batch except the random draw: each request draws its
noise from its own ``torch.Generator``, so a seeded request produces the same tokens
whatever other requests share its batch, and wherever it sits in it.

A request whose parameters break a step (say a top_k no tensor can hold) fails alone: the
batch is sampled again row by row from the same logits and random state, so every other row
gets exactly the token it would have got, and the culprit gets an error instead.

Drawing and reading are two calls (``Sampler.launch``, then ``PendingSample.result``), so that
on a GPU the host can queue the next step's forward before it waits for this step's tokens
(the worker's overlapped loop); ``Sampler.sample`` does both at once.

Speculative decoding (prompt lookup) checks drafts with ``Sampler.verify``: a request with k draft
tokens brings k + 1 rows of logits, and row j goes through the pipeline above as if draft tokens
0..j-1 had been emitted (its matcher fed them, min_tokens and the penalties count them). Greedy
rows keep the draft while it is the argmax; sampling rows keep draft token t with probability p(t)
and, at the first rejection, draw from p without t (speculative sampling with a one-hot draft:
the tokens come out as ``sample`` would draw them). All rows at once, one read of the device: an
all-greedy batch reads every row's argmax and finds the accepted runs on the host; a batch with
sampling requests decides on the device (its last draws need the runs there), its per-row host
columns sent in one copy. On a GPU these steps cost launches and transfers, not arithmetic.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import torch

from llmserve.ipc import error_line
from llmserve.kernels import apply_penalty
from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance
    import numpy as np

    from llmserve.grammar import GrammarCompiler

# Below this temperature, logits / temperature can overflow float32 and softmax returns
# NaN; such a request is sampled greedily instead (which is what T -> 0 tends to anyway).
_MIN_TEMPERATURE = 1e-5


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


@dataclass
class _RequestState:
    params: SamplingParams
    # One entry per distinct token of prompt + output, mapped to how often it occurs in
    # the OUTPUT (0 for a token seen only in the prompt): exactly what the penalty kernel
    # wants, kept up to date at O(1) per sampled token.
    token_counts: dict[int, int]
    seed: int
    # Token ids that may not be sampled before min_tokens tokens are out: EOS and stop ids.
    min_tokens_banned: list[int]
    # Tokens sampled so far. The state outlives a preemption, so this is the output length
    # the request has reached, however often it was prefilled.
    num_sampled: int = 0
    # Created on first use, because only then do we know the device of the logits.
    generator: torch.Generator | None = field(default=None)
    # Where the request stands in its grammar (guided_decoding), or None: unconstrained. Like
    # the counts it outlives a preemption, so a re-prefilled request goes on where it was.
    matcher: llguidance.LLMatcher | None = None

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

    @property
    def below_min_tokens(self) -> bool:
        return self.num_sampled < self.params.min_tokens

    def generator_on(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        return self.generator


class Sampler:
    """Per-request sampling state, and the batched sampling step."""

    def __init__(self, eos_token_ids: Iterable[int] = (), grammar: GrammarCompiler | None = None) -> None:
        self._requests: dict[int, _RequestState] = {}
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
        self._requests[req_id] = _RequestState(
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
        saved = [_RandomState.save(s) for s in states]
        try:
            # On a copy, so a failed attempt leaves the rows as the forward made them for the
            # retry (the copy is small beside the lm_head matmul that made the logits).
            return _sample_batch(logits.clone(), states)
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
        saved = [_RandomState.save(s) for s in states]
        fed = [0] * len(states)
        try:
            # On a copy where the processing writes to the rows, as launch; a greedy or plainly
            # sampled batch only reads them, and its rows are (1 + draft) times a step's.
            return _verify_batch(logits.clone() if _edits_logits(states) else logits, states, draft_token_ids, fed)
        except Exception:
            for snapshot in saved:
                snapshot.restore()
            _unfeed(states, fed)
        return self._verify_one_by_one(logits, states, draft_token_ids)

    @staticmethod
    def _verify_one_by_one(logits: torch.Tensor, states: list[_RequestState],
                           draft_token_ids: list[list[int]]) -> VerifyResult:
        """The slow path after a failed batch: each request alone, its failure its own."""
        starts = [0]
        for draft in draft_token_ids:
            starts.append(starts[-1] + 1 + len(draft))

        def one(i: int) -> VerifyResult:
            saved, fed = _RandomState.save(states[i]), [0]
            try:
                return _verify_batch(logits[starts[i] : starts[i + 1]].clone(), [states[i]], [draft_token_ids[i]], fed)
            except Exception:
                saved.restore()
                _unfeed([states[i]], fed)
                raise

        return _each_alone(VerifyResult([], [], [], []), len(states), one, no_tokens=list)

    @staticmethod
    def _sample_row_by_row(logits: torch.Tensor, states: list[_RequestState]) -> SampleResult:
        """The slow path after a failed batch: each row alone, its failure its own."""
        def one(row: int) -> SampleResult:
            return _sample_batch(logits[row : row + 1].clone(), [states[row]]).result()

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


class PendingSample:
    """One batch's draw, on its way from the device to the host.

    ``token_ids`` (on the device, one per row; 0 where the row failed) can feed the next
    step's forward before the host has read them; ``result()`` waits for the copies and
    returns the ``SampleResult``, counting the tokens into their requests' penalty state once."""

    def __init__(self, states: list[_RequestState], token_ids: torch.Tensor, host: dict[str, torch.Tensor],
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
                    errors[row] = _advance_matcher(state.matcher, token_id)
            logprobs, top_logprobs = _logprob_lists(self._host, self._logprob_rows, self._states)
            self._result = SampleResult(token_ids, logprobs, top_logprobs, errors)
        return self._result


@dataclass
class _RandomState:
    """A request's random stream as it was before an attempt, so that an attempt that failed
    part-way (some rows drawn, then an error) does not advance it twice."""
    request: _RequestState
    generator_state: torch.Tensor | None

    @classmethod
    def save(cls, state: _RequestState) -> _RandomState:
        return cls(state, None if state.generator is None else state.generator.get_state())

    def restore(self) -> None:
        if self.generator_state is None:
            self.request.generator = None    # created on first use: the next use re-seeds it
        else:
            self.request.generator.set_state(self.generator_state)


def _sample_batch(logits: torch.Tensor, states: list[_RequestState]) -> PendingSample:
    """The pipeline over all rows at once (``logits`` is modified in place), queued on the
    device. The requests' state changes only once every step has been queued: the number
    sampled now, the token counts when the result is read."""
    raw_logprobs = _raw_logprobs(logits, states)  # before the penalties touch logits
    _apply_grammar(logits, states)
    _ban_stop_tokens_below_min_tokens(logits, states)
    _apply_penalties(logits, states)
    token_ids = _choose_tokens(logits, states)
    device_out, logprob_rows = _gather_logprobs(raw_logprobs, token_ids, states)
    device_out["token_ids"] = token_ids
    host, ready = _copy_to_host(device_out)
    for state in states:
        state.num_sampled += 1
    return PendingSample(states, token_ids, host, logprob_rows, ready)


# --------------------------------------------------------------------------------------
# Pipeline steps
# --------------------------------------------------------------------------------------


def _on(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of ``values`` on ``device``, copied without waiting for the device: a blocking
    copy (``torch.tensor(values, device=...)`` makes one) would wait for the step queued before
    it, which the overlapped loop keeps running while this one is prepared."""
    return _columns_on(device, (values, dtype))[0]


def _columns_on(device: torch.device, *columns: tuple[list | np.ndarray, torch.dtype | None]) -> list[torch.Tensor]:
    """``_on`` for several columns (values: a list or a numpy array; dtype) at once: on a GPU one
    copy from pinned memory (the columns side by side as bytes, each at an 8-byte boundary, viewed
    back on the device without a kernel), since each copy costs a launch and a transfer however
    small it is."""
    host = [torch.as_tensor(values, dtype=dtype) for values, dtype in columns]
    if device.type == "cpu":
        return host
    sizes = [t.numel() * t.element_size() for t in host]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + (size + 7) // 8 * 8)
    staging = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=True)
    for t, offset, size in zip(host, offsets, sizes):
        staging[offset : offset + size] = t.view(torch.uint8)
    # The caching host allocator keeps the staging buffer until the copy is done.
    packed = staging.to(device, non_blocking=True)
    return [packed[offset : offset + size].view(t.dtype) for t, offset, size in zip(host, offsets, sizes)]


def _copy_to_host(device_out: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
    """Copies of the tensors on the host that do not wait for the device, and an event recorded after
    them that says when they are done (None on the CPU: done already)."""
    host = {name: t.to("cpu", non_blocking=True) for name, t in device_out.items()}
    ready = None
    if any(t.is_cuda for t in device_out.values()):
        ready = torch.cuda.Event()
        ready.record()
    return host, ready


def _read_to_host(device_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``_copy_to_host``, waited for: every tensor read back with one wait for the device."""
    host, ready = _copy_to_host(device_out)
    if ready is not None:
        ready.synchronize()
    return host


def _row_indices(selected: list[bool], device: torch.device) -> torch.Tensor:
    """The indices of the selected batch rows, as an index tensor."""
    return _on([i for i, is_selected in enumerate(selected) if is_selected], device, torch.long)


def _raw_logprobs(logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor | None:
    """log_softmax of the rows that asked for logprobs ([n_asking, vocab]), or None."""
    asking = [s.wants_logprobs for s in states]
    if not any(asking):
        return None
    if all(asking):
        return torch.log_softmax(logits, dim=-1)
    return torch.log_softmax(logits[_row_indices(asking, logits.device)], dim=-1)


def _apply_grammar(logits: torch.Tensor, states: list[_RequestState]) -> None:
    """Mask to -inf, in place, every token a constrained row's grammar does not allow next."""
    rows = [i for i, s in enumerate(states) if s.matcher is not None]
    if not rows:
        return
    words = _grammar_bitmask([states[i].matcher for i in rows], _mask_words(logits.shape[-1]))
    _mask_disallowed(logits, rows, words)


def _mask_words(vocab_size: int) -> int:
    """How many int32 words a bitmask over ``vocab_size`` tokens takes."""
    return (vocab_size + 31) // 32


def _mask_disallowed(logits: torch.Tensor, rows: list[int], words) -> None:
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
    index = _on(rows, logits.device, torch.long)
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


def _advance_matcher(matcher: llguidance.LLMatcher, token_id: int) -> str | None:
    """Feed the drawn token to the request's matcher; why the request must fail, or None.

    The mask keeps a drawn token inside the grammar, so a refusal means no token was allowed
    (say, EOS banned by min_tokens where the grammar allowed nothing else)."""
    if matcher.consume_token(token_id):
        return None
    return f"GrammarError: token {token_id} is outside the guided_decoding grammar: {matcher.get_error()}"


def _ban_stop_tokens_below_min_tokens(logits: torch.Tensor, states: list[_RequestState]) -> None:
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
        row_index, col_index = _columns_on(logits.device, (rows, torch.long), (cols, torch.long))
        logits[row_index, col_index] = float("-inf")


def _apply_penalties(logits: torch.Tensor, states: list[_RequestState]) -> None:
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
    columns = _columns_on(
        logits.device,
        ([s.params.presence_penalty for s in states], torch.float32),
        ([s.params.frequency_penalty for s in states], torch.float32),
        ([s.params.repetition_penalty for s in states], torch.float32),
        (np.concatenate(token_ids), torch.int32),
        (np.concatenate(token_counts), torch.int32),
        (cumsum_seq_len, torch.int32),
    )
    apply_penalty(logits, *columns, max_len_in_batch)


def _choose_tokens(logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
    """One token id per row: argmax for greedy rows, a random draw for the others."""
    if all(s.is_greedy for s in states):
        return logits.argmax(dim=-1)
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
    """Warp, then draw from what is left ([n, vocab] -> [n])."""
    probs = torch.softmax(_warp(logits, states), dim=-1)
    return _draw(probs, states)


def _warp(logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
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
    temperatures, *rest = _columns_on(logits.device, *columns)
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


def _draw(probs: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
    """Sample one token per row of ``probs`` with each row's own generator.

    argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with probability p_i (the
    exponential race, equivalent to the Gumbel-max trick), needs no cumulative sum, and
    lets every row take its noise from its own generator.
    """
    noise = _exponential_noise([s.generator_on(probs.device) for s in states], probs.shape[-1], probs.device,
                               probs.dtype)
    return (probs / noise).argmax(dim=-1)


def _exponential_noise(generators: list[torch.Generator | None], vocab_size: int, device: torch.device,
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


def _gather_logprobs(
    raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor, states: list[_RequestState]
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """On the device, for the rows that asked for logprobs: the chosen token's raw logprob and
    the most likely alternatives (as many as the greediest row wants); and those rows."""
    if raw_logprobs is None:
        return {}, []
    rows = [i for i, s in enumerate(states) if s.wants_logprobs]
    chosen_ids = token_ids if len(rows) == len(states) else token_ids[_on(rows, token_ids.device)]
    chosen = raw_logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    top_values, top_ids = _topk(raw_logprobs, max(states[i].params.logprobs for i in rows))
    return {"chosen": chosen, "top_values": top_values, "top_ids": top_ids}, rows


def _logprob_lists(
    host: dict[str, torch.Tensor], rows: list[int], states: list[_RequestState]
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


# --------------------------------------------------------------------------------------
# Speculative verification
# --------------------------------------------------------------------------------------


def _verify_batch(logits: torch.Tensor, states: list[_RequestState], drafts: list[list[int]],
                  fed: list[int]) -> VerifyResult:
    """``Sampler.verify`` over all requests at once (``logits`` is modified in place). ``fed[i]``
    counts the draft tokens request i's matcher has taken so far, so that a failure can undo them."""
    starts = [0]
    for draft in drafts:
        starts.append(starts[-1] + 1 + len(draft))
    if logits.shape[0] != starts[-1]:
        raise ValueError(f"verify: {logits.shape[0]} rows of logits for {starts[-1]} (1 + draft per request)")
    rows = [row for state, draft in zip(states, drafts) for row in _row_states(state, draft)]
    raw_logprobs = _raw_logprobs(logits, rows)  # before the penalties touch logits
    _apply_draft_grammar(logits, states, drafts, starts, fed)
    _ban_stop_tokens_below_min_tokens(logits, rows)
    _apply_penalties(logits, rows)
    if all(s.is_greedy for s in states):
        decided = _decide_greedy(logits, raw_logprobs, rows, drafts, starts)
    else:
        decided = _decide_on_device(logits, raw_logprobs, states, rows, drafts, starts)
    return _verify_result(decided, states, drafts, starts, fed)


@dataclass
class _Decided:
    """What verify decided, on the host: per request, how many draft tokens it keeps and the token
    after them; and the logprobs of the emitted rows (``_gather_logprobs``' tensors, copied)."""
    num_accepted: list[int]
    next_ids: list[int]
    logprobs: dict[str, torch.Tensor]
    logprob_rows: list[int]


def _decide_greedy(logits: torch.Tensor, raw_logprobs: torch.Tensor | None, rows: list[_RequestState],
                   drafts: list[list[int]], starts: list[int]) -> _Decided:
    """An all-greedy batch: the argmax of every row on the device, one read, the accepted runs on the
    host (a few hundred ints). ``_decide_on_device``'s rule for greedy rows: a draft token is kept
    where it is the argmax and the processing left it allowed (> -inf)."""
    best = logits.argmax(dim=-1)
    # Where the draft token is the argmax, it is banned exactly when the argmax is: a row whose
    # every token is banned (or NaN, which argmax picks and no comparison passes).
    allowed = logits.gather(1, best.unsqueeze(1)).squeeze(1) > float("-inf")
    # Every emitted row emits its argmax (an accepted draft token is one), so its logprob is there.
    device_out, logprob_rows = _gather_logprobs(raw_logprobs, best, rows)
    host = _read_to_host(device_out | {"best": best, "allowed": allowed})
    best_ids, allowed_rows = host["best"].tolist(), host["allowed"].tolist()
    num_accepted: list[int] = []
    for start, draft in zip(starts, drafts):
        n = 0
        while n < len(draft) and allowed_rows[start + n] and best_ids[start + n] == draft[n]:
            n += 1
        num_accepted.append(n)
    next_ids = [best_ids[start + n] for start, n in zip(starts, num_accepted)]
    return _Decided(num_accepted, next_ids, host, logprob_rows)


def _decide_on_device(logits: torch.Tensor, raw_logprobs: torch.Tensor | None, states: list[_RequestState],
                      rows: list[_RequestState], drafts: list[list[int]], starts: list[int]) -> _Decided:
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
    checked_ids, checkable, greedy_row, run_index, first_rows, draft_lengths, random_request, random_index = _columns_on(
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
    device_out, logprob_rows = _gather_logprobs(raw_logprobs, emitted_ids, rows)
    host = _read_to_host(device_out | {"num_accepted": num_accepted, "next_ids": next_ids})
    return _Decided(host["num_accepted"].tolist(), host["next_ids"].tolist(), host, logprob_rows)


def _verify_probs(logits: torch.Tensor, rows: list[_RequestState], random_index: torch.Tensor | None) -> torch.Tensor:
    """The distribution ``sample`` draws from at each sampling row (warped); zeros at greedy rows.
    ``random_index``: the sampling rows, or None where every row samples."""
    if random_index is None:
        return torch.softmax(_warp(logits, rows), dim=-1)
    probs = torch.zeros_like(logits)
    probs[random_index] = torch.softmax(_warp(logits[random_index], [r for r in rows if not r.is_greedy]), dim=-1)
    return probs


def _edits_logits(states: list[_RequestState]) -> bool:
    """Whether processing these requests' rows writes to the logits: grammar masks, min_tokens
    bans, penalties (the warpers make new tensors)."""
    return any(s.matcher is not None or s.below_min_tokens or s.has_penalties for s in states)


def _row_states(state: _RequestState, draft: list[int]) -> list[_RequestState]:
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


def _apply_draft_grammar(logits: torch.Tensor, states: list[_RequestState], drafts: list[list[int]],
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
                words = np.zeros(_mask_words(vocab_size), dtype=np.int32)
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
    _mask_disallowed(logits, rows, np.stack(masks))


def _allows(words, token_id: int, vocab_size: int) -> bool:
    """Whether a bitmask (one row of int32 words, llguidance's layout) allows ``token_id``."""
    return 0 <= token_id < vocab_size and bool((int(words[token_id >> 5]) >> (token_id & 31)) & 1)


def _unfeed(states: list[_RequestState], fed: list[int]) -> None:
    """Take back the draft tokens a failed attempt fed the matchers."""
    for i, state in enumerate(states):
        if state.matcher is not None and fed[i]:
            state.matcher.rollback(fed[i])
        fed[i] = 0


def _verify_noise(states: list[_RequestState], drafts: list[list[int]], vocab_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, a uniform that decides its draft token; per request, the exponential noise of its
    last draw (``_exponential_noise``). Each sampling request takes them from its own generator,
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
    return uniforms, _exponential_noise(generators, vocab_size, device)


def _verify_result(decided: _Decided, states: list[_RequestState], drafts: list[list[int]], starts: list[int],
                   fed: list[int]) -> VerifyResult:
    """The emitted tokens per request, counted into its state: the penalties' counts, min_tokens,
    and its matcher (rolled back to the accepted prefix, then fed the rest)."""
    rows = [state for state, draft in zip(states, drafts) for _ in range(len(draft) + 1)]
    row_logprobs, row_top_logprobs = _logprob_lists(decided.logprobs, decided.logprob_rows, rows)
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
                error = error or _advance_matcher(state.matcher, token_id)
        for token_id in token_ids:
            state.token_counts[token_id] = state.token_counts.get(token_id, 0) + 1
        state.num_sampled += len(token_ids)
        emitted_rows = range(starts[i], starts[i] + n + 1)
        result.token_ids.append(token_ids)
        result.logprobs.append([row_logprobs[r] for r in emitted_rows] if state.wants_logprobs else None)
        result.top_logprobs.append([row_top_logprobs[r] for r in emitted_rows] if state.wants_logprobs else None)
        result.errors.append(error)
    return result


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
