"""Speculation's policy: which decodes of a step may bring a draft, and how long a one.

With ``speculate`` > 0, a decoding request may bring a prompt-lookup draft after its sampled
token, so that one forward verifies them all. (Constrained requests draft too: the verifier judges
each draft token in the grammar's state after the ones before it.) The engine does not know the
draft: it grants a budget (``ScheduledRequest.draft_budget``), and rank 0's worker, which knows
every token it sampled first, proposes the draft from its n-gram index of the request
(``worker/prompt_lookup.py``) right before the forward. So a draft may follow a token still in
flight, and every step stays in the overlapped loop, drafting or not.

The scheduler gives budgets what its step leaves: the prefill budget's rest, and the KV slots
left once the prompts under way and one next decode per running request are provided for; a
budget is shortened or dropped when room is short, so it never causes a preemption. A budget
never lets a request pass ``max_new_tokens``, counting every token it may have in flight
(``Request.max_num_output_tokens``), the verify step's own token being the last. Batches of more
than ``max_batch`` decodes take no drafts: there, verifying costs the device more than the accepted
tokens save. A request whose drafts keep gaining nothing (no n-gram of its end recurs, or the model
accepts none of a well-matched draft) backs off: see ``Drafter.verified``; with the overlapped
loop its back-off starts a step late (the step after a verify is scheduled before it is read).

How long a budget: the step's budgets are planned together (``DraftCost.draft_lengths``), from
each request's recent acceptance (``DraftState.acceptance``) and what the step costs: on a CPU
every row of a step costs (a decode step of 8 requests is about 2.5 of one request's, a draft
token's row 0.13), and a step that carries drafts takes the verify path with all its rows, so at
batch 8 a verify pays only where several requests' drafts are likely kept. The likeliest draft
tokens of the step are taken first, as many as raise its tokens per unit of time: a request
whose copy keeps diverging drafts a token or two or none, one copying a passage the whole
``speculate``. A request left out for its acceptance sits the next step out and its evidence
fades toward the prior, so it tries again a few steps later; left out for an acceptance that
would not pay even alone, it backs off as after a miss (1, 3, then 7 steps; up to 15 while none of
its draft tokens has ever been accepted). A back-off ends early when rank 0 reports a long match
(``LONG_MATCH``: after every step it reads, the match each drafting request's next draft would
continue): a copy has started, of the prompt or of the output's own loop, and waiting would miss
its start. The worker's draft is at most the budget, and shorter where its match supports less
(2 tokens per matched token).

Left of issue 35 (its first part, drafts inside the overlapped loop, is this): verify steps as
cheap as decode steps (the split-K attention path for few-token verify batches is
kernels/verify_attention, still to be measured on a GPU: offline.py --verify; on a CPU, per-row
costs that follow the accepted work), and the GPU measurements. The budget follows the engine's
estimate of each request's acceptance and the match rank 0 reported (a step late under overlap).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.engine.request import Request
from llmserve.worker.prompt_lookup import LONG_MATCH

if TYPE_CHECKING:
    from llmserve.engine.scheduler import ScheduledRequest

# The most decode steps a request whose drafts gain nothing sits out between two lookups, and
# one left out for its acceptance (`Drafter.add_drafts`) once a draft of it was accepted: shorter,
# because a request that copies its own output's loops has that acceptance between loops, and its
# wait delays the next loop's drafts (`answer` in benchmarks/prompt_lookup.py). One never accepted
# (free text guessing from lone recurring tokens) waits up to MAX_DRAFT_WAIT: each of its tries is
# a failed verify step, which on an H200 with the embedded model cost 0.4-1 of a decode step (the
# overlapped loop's look-ahead is lost on that step and the next), so with a try every 8 steps free
# text ran at 0.96x there (benchmarks/README.md, 2026-11-28).
MAX_DRAFT_WAIT = 15
MAX_SKIP_WAIT = 7
# A long match (worker/prompt_lookup.LONG_MATCH tokens of a request's end that recur together, as
# rank 0 reports each step) says a copy is under way, a passage or a loop of the output: it ends
# the request's back-off, and its draft is planned at the prior's acceptance at least, until a
# draft from that copy is rejected whole. On the CPU's `prompt_lookup.py` rows at batch 1
# (2026-11-28), waits that ignored matches had `answer` miss its loops' starts (1.64 tokens a
# forward; 2.16 with this) and code edits their copies' restarts (1.13; 1.70); free text's matches
# rarely reach 4 tokens.
# A request's acceptance before its first verify (the chance that each next draft token is
# accepted), as if seen over ``PRIOR_WEIGHT`` draft tokens, and how much each verify's evidence
# fades per later verify: the estimate follows the last few drafts.
PRIOR_ACCEPTANCE = 0.7
PRIOR_WEIGHT = 1.0
ACCEPTANCE_DECAY = 0.7


@dataclass(frozen=True)
class DraftCost:
    """What a step costs the device, in decode steps of one request: a decode step of ``B``
    requests costs 1 + ``per_request`` * (B - 1). One that carries drafts costs ``per_step`` +
    ``per_request_verified`` * B more (the verify path, taken by every row of the step: all rows'
    logits, the verifier, the causal attention of several queries), and ``per_token`` more for
    each draft token's row. Zero (a bare scheduler's): every draft is as long as its match allows."""
    per_step: float = 0.0
    per_token: float = 0.0
    per_request: float = 0.0
    per_request_verified: float = 0.0

    def draft_lengths(self, acceptances: list[float], limits: list[int]) -> list[int]:
        """The draft lengths (each at most its ``limits`` entry) for a step of ``len(acceptances)``
        decodes that emit the most tokens per unit of the step's cost, if each draft token of
        decode ``i`` is accepted with chance ``acceptances[i]`` given the ones before it: its
        ``n``-th draft token adds ``acceptances[i] ** n`` tokens and ``per_token`` to the cost.
        The step's draft tokens are taken likeliest first (so a request whose drafts keep being
        accepted drafts long, one whose drafts keep failing none), as many as raise the step's
        rate; all zero where no drafts beat the plain decode step."""
        num_decodes = len(acceptances)
        decode_step = 1 + self.per_request * (num_decodes - 1)
        gains = sorted(((a ** n, i) for i, (a, k) in enumerate(zip(acceptances, limits)) for n in range(1, k + 1)),
                       key=lambda gain: -gain[0])    # (stable: ties keep the earlier decode's first)
        emitted, cost = float(num_decodes), decode_step + self.per_step + self.per_request_verified * num_decodes
        taken, best_rate = 0, num_decodes / decode_step
        for j, (gain, _) in enumerate(gains, 1):
            emitted += gain
            cost += self.per_token
            rate = emitted / cost
            if rate >= best_rate:      # ties keep more drafts (a zero cost: every limit)
                taken, best_rate = j, rate
        lengths = [0] * num_decodes
        for _, i in gains[:taken]:
            lengths[i] += 1
        return lengths

    def best_length(self, acceptance: float, k: int) -> int:
        """The draft length of at most ``k`` that pays best for a decode alone in its step."""
        return self.draft_lengths([acceptance], [k])[0]


# By device (EngineConfig's), the embedded model's steps in units of its batch-1 decode step.
# CPU (benchmarks/README.md, "prompt_lookup.py", 2026-11-27): a verify of 1 + 1 tokens costs about
# 1.3x a decode, 1 + 2 1.45x, 1 + 10 2.5x (0.17 + 0.13 a row); a decode step of 8 requests 2.4-2.7x
# (0.22 a request); and the batch-8 verify steps of that table's "on" runs took 0.1 a request more
# than their decode step and draft rows did (0.7-1.0 at batch 8). GPU: 1.16-1.19x whatever the
# draft's length, a decode step's cost flat in its batch at these sizes.
DRAFT_COSTS = {"cpu": DraftCost(per_step=0.07, per_token=0.13, per_request=0.22, per_request_verified=0.1),
               "cuda": DraftCost(per_step=0.17, per_token=0.005)}


@dataclass
class DraftState:
    """One request's drafting: its draft attempts in a row that gained nothing, the decode steps
    it sits out before its next budget, its recent drafts' tokens accepted and rejections (each
    faded by ``ACCEPTANCE_DECAY`` a verify), and whether any draft token of it was ever accepted."""

    num_misses: int = 0
    wait: int = 0
    accepted: float = 0.0
    rejected: float = 0.0
    ever_accepted: bool = False
    # The match its next draft would continue (rank 0's latest report), and whether a draft from
    # the copy that match belongs to was rejected whole (then the match is no longer evidence).
    match_len: int = 0
    copy_failed: bool = False

    @property
    def copying(self) -> bool:
        """Whether the request's end is a long match that no draft has failed on yet."""
        return self.match_len >= LONG_MATCH and not self.copy_failed

    @property
    def acceptance(self) -> float:
        """The chance that the next draft token is accepted, given the ones before it: accepted
        tokens over the draft tokens the verifies judged (each accepted one, and the first
        rejected one of a draft: the rows after it were never judged), with the prior's weight."""
        return ((self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT)
                / (self.accepted + self.rejected + PRIOR_WEIGHT))

    def judged(self, num_drafted: int, num_accepted: int) -> None:
        self.fade()
        self.accepted += num_accepted
        self.rejected += num_accepted < num_drafted
        self.ever_accepted |= num_accepted > 0

    def fade(self) -> None:
        """Older evidence counts less: a request skipped for its low acceptance drifts back to
        the prior, and so drafts again after a few steps."""
        self.accepted *= ACCEPTANCE_DECAY
        self.rejected *= ACCEPTANCE_DECAY


class Drafter:
    def __init__(self, speculate: int, max_batch: int, cost: DraftCost = DraftCost()) -> None:
        self.speculate = speculate      # draft tokens per decoding request per step, at most; 0: off
        self.max_batch = max_batch
        self.cost = cost
        # The requests that have asked for a draft, until they finish (``forget``).
        self.states: defaultdict[Request, DraftState] = defaultdict(DraftState)

    def takes_drafts(self, num_decodes: int) -> bool:
        """Whether a step of ``num_decodes`` decodes takes drafts: speculation is on, and the batch
        is small enough that verifying pays."""
        return 0 < self.speculate and num_decodes <= self.max_batch

    def add_drafts(self, decodes: list[ScheduledRequest], room: int) -> int:
        """Grant the step's decodes their draft budgets, ``room`` tokens in all at most; returns
        how many draft slots they took. Each budget is what pays given every decode's recent
        acceptance and the step's cost (``DraftCost.draft_lengths``)."""
        acceptances, limits = [0.0] * len(decodes), [0] * len(decodes)
        for i, s in enumerate(decodes):
            req = s.request
            if not req.params.speculate:
                continue
            state = self.states[req]
            if state.wait:
                if not state.copying:
                    state.wait -= 1
                    continue
                state.wait = 0      # a copy has started: its back-off ends
            acceptances[i] = max(state.acceptance, PRIOR_ACCEPTANCE) if state.copying else state.acceptance
            limits[i] = max(0, min(self.speculate, req.params.max_new_tokens - req.max_num_output_tokens - 1))
        for s, k, acceptance, limit in zip(decodes, self.cost.draft_lengths(acceptances, limits), acceptances, limits):
            if limit and not k:
                # At its recent acceptance its draft does not pay: it sits this step and the next
                # out, its evidence fading (a copy may start later). If it would not pay even
                # alone in its step, that counts as a miss: free text, whose lone-token guesses
                # (no miss in `verified`) keep failing, then retries after ever longer waits, not
                # every few steps as its evidence fades back.
                state = self.states[s.request]
                if not self.cost.best_length(acceptance, limit):
                    self._missed(state, MAX_SKIP_WAIT if state.ever_accepted else MAX_DRAFT_WAIT)
                state.fade()
                state.wait = max(state.wait, 1)
            s.draft_budget = max(0, min(k, room))
            room -= s.draft_budget
        return sum(s.draft_budget for s in decodes)

    def verified(self, s: ScheduledRequest, num_drafted: int, match_len: int, num_accepted: int) -> None:
        """The step that granted ``s`` a budget is read: the worker drafted ``num_drafted`` tokens
        (their match was ``match_len`` tokens) and kept ``num_accepted`` of them. The back-off's
        rules, in order:

        1. A lookup that found nothing is a miss (``_missed``).
        2. A draft with any token accepted puts the request back to drafting every step
           (``num_misses`` = 0).
        3. A draft rejected whole is a miss if its match was 2 tokens or more. One that continued
           a lone recurring token is a guess of 2 tokens at most (see worker/prompt_lookup.py),
           cheap to verify and often wrong: it costs the request nothing here.
        4. A draft of a long match rejected whole marks its copy failed (``copy_failed``): that
           match no longer ends a back-off, until a shorter one ends the copy (``matched``).

        From the second miss in a row the request sits out 1, 3, 7, then 15 decode steps
        (``wait``) before it looks for a draft again. An answer that copies nothing then costs
        a lookup every 16 steps rather than a verify step every step, while one that copies in
        runs keeps drafting."""
        state = self.states[s.request]
        if not num_drafted:
            self._missed(state)
            return
        state.judged(num_drafted, num_accepted)
        if num_accepted:
            state.num_misses = 0
        elif match_len >= 2:
            self._missed(state)
        state.copy_failed = not num_accepted and match_len >= LONG_MATCH

    def matched(self, req: Request, match_len: int) -> None:
        """Rank 0 read a step of ``req``: a draft proposed now would continue a match of
        ``match_len`` tokens. A match shorter than ``LONG_MATCH`` ends the copy a failed draft
        belonged to, so the next long one is evidence again."""
        if not req.params.speculate:
            return
        state = self.states[req]
        state.match_len = match_len
        state.copy_failed &= match_len >= LONG_MATCH

    def forget(self, req: Request) -> None:
        """The request finished: its state goes."""
        self.states.pop(req, None)

    @staticmethod
    def _missed(state: DraftState, max_wait: int = MAX_DRAFT_WAIT) -> None:
        state.num_misses += 1
        state.wait = min(2 ** (state.num_misses - 1), max_wait + 1) - 1
