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

How long a budget: the length that pays best given what the request's recent drafts had accepted
(``DraftCost``, ``DraftState.acceptance``); the worker's draft is at most that, and shorter where
its match supports less (2 tokens per matched token). A rejected draft token still costs its row
of the verify step, so a request whose copy keeps diverging drafts a token or two, and one copying
a passage drafts the whole ``speculate``.

Left of issue 35 (its first part, drafts inside the overlapped loop, is this): verify steps as
cheap as decode steps (a split-K attention path for few-token verify batches; on a CPU, per-row
costs that follow the accepted work), the budget sized by rank 0's own match and acceptance (it
is the engine's estimate here, a step late under overlap), and the GPU measurements.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.engine.request import Request

if TYPE_CHECKING:
    from llmserve.engine.scheduler import ScheduledRequest

# The most decode steps a request whose drafts gain nothing sits out between two lookups.
MAX_DRAFT_WAIT = 15
# A request's acceptance before its first verify (the chance that each next draft token is
# accepted), as if seen over ``PRIOR_WEIGHT`` draft tokens, and how much each verify's evidence
# fades per later verify: the estimate follows the last few drafts.
PRIOR_ACCEPTANCE = 0.7
PRIOR_WEIGHT = 1.0
ACCEPTANCE_DECAY = 0.7


@dataclass(frozen=True)
class DraftCost:
    """What a verify step costs beyond a decode step, in decode steps: ``per_step`` for carrying
    a draft at all, ``per_token`` for each draft token's row. Zero (a bare scheduler's): every
    draft is as long as its match allows."""
    per_step: float = 0.0
    per_token: float = 0.0

    def best_length(self, acceptance: float, k: int) -> int:
        """The draft length of at most ``k`` that emits the most tokens per decode step's worth of
        time, if each draft token is accepted with chance ``acceptance`` given the ones before it:
        1 + a + ... + a^n tokens for 1 + per_step + n * per_token; 0 where no draft beats a plain
        decode (one token a step)."""
        best, best_rate, emitted = 0, 1.0, 1.0
        for n in range(1, k + 1):
            emitted += acceptance ** n
            rate = emitted / (1 + self.per_step + n * self.per_token)
            if rate >= best_rate:      # ties keep the longer draft (a zero cost: all of k)
                best, best_rate = n, rate
            elif self.per_token:
                break                  # the rate rises, then falls: past its peak
        return best


# By device (EngineConfig's): a verify step against a decode step of the embedded model, batch 1.
# CPU: 1 + 1 tokens cost about 1.3x, each further row 6-8% (the quantized kernel's rows, the
# attention's queries, a row of logits). GPU: 1.16-1.19x whatever the draft's length
# (benchmarks/README.md, "prompt_lookup.py").
DRAFT_COSTS = {"cpu": DraftCost(per_step=0.2, per_token=0.08), "cuda": DraftCost(per_step=0.17, per_token=0.005)}


@dataclass
class DraftState:
    """One request's drafting: its draft attempts in a row that gained nothing, the decode steps
    it sits out before its next budget, and its recent drafts' tokens accepted and rejections
    (each faded by ``ACCEPTANCE_DECAY`` a verify)."""

    num_misses: int = 0
    wait: int = 0
    accepted: float = 0.0
    rejected: float = 0.0

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
        how many draft slots they took."""
        for s in decodes:
            req = s.request
            if room <= 0:
                break
            if not req.params.speculate:
                continue
            state = self.states[req]
            if state.wait:
                state.wait -= 1
                continue
            k = min(self.speculate, req.params.max_new_tokens - req.max_num_output_tokens - 1, room)
            if k <= 0:
                continue
            k = self.cost.best_length(state.acceptance, k)
            if k == 0:
                # At its recent acceptance no draft pays: it sits this step and the next out, its
                # evidence fading (a copy may start later).
                state.fade()
                state.wait = max(state.wait, 1)
                continue
            s.draft_budget = k
            room -= k
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

    def forget(self, req: Request) -> None:
        """The request finished: its state goes."""
        self.states.pop(req, None)

    @staticmethod
    def _missed(state: DraftState) -> None:
        state.num_misses += 1
        state.wait = min(2 ** (state.num_misses - 1), MAX_DRAFT_WAIT + 1) - 1
