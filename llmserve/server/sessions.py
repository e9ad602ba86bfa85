"""Interactive sessions (LMDeploy's ``/v1/chat/interactive``): the HTTP process keeps each
conversation's tokens, so that a client sends only its new turn.

A session holds the token ids of its conversation exactly as the engine saw them: the first
turn's prompt (the chat template rendered with ``sequence_start=True``), then per turn the
answer's generated content tokens and the template's continuation (``BaseTemplate.continuation``:
the answer's end, the new turn, the next answer's opening). A turn's prompt is those tokens, so
the engine's prefix cache, where the session's previous turn is pinned (``AddRequest.session_id``),
holds all of it but the tokens no step has fed yet: the continuation, and after an answer cut by
its length limit, that answer's last token.

Everything here runs on the event loop: no lock. The store is bounded: ``max_sessions`` (the
least recently used idle session is ended to make room) and an idle timeout; ending a session
tells the engine (``EndSession``), which unpins its tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from llmserve.engine.request import FinishReason
from llmserve.output import ClientRequest
from llmserve.server.api.errors import APIError
from llmserve.server.engine_client import RequestStream

NEW_SESSION = -1            # LMDeploy's session_id for "the server picks one"
MAX_SESSION_ID = 2**63 - 1


@dataclass(eq=False)
class Session:
    session_id: int
    token_ids: list[int] = field(default_factory=list)   # the conversation so far, as the engine saw it
    num_turns: int = 0
    last_used: float = 0.0                                # the store's clock; set by the store
    # A turn is being prepared or run: another one is refused until it ends.
    busy: bool = False
    # The running turn's stream, once it has started (what ``cancel`` stops).
    running: RequestStream | None = None
    ended: bool = False         # out of the store: a turn still being prepared must not start

    @property
    def engine_id(self) -> str:
        """The id the engine knows the session by (``AddRequest.session_id``, ``EndSession``)."""
        return str(self.session_id)


def session_busy_error(session_id: int) -> APIError:
    return APIError(f"session {session_id} is still running its previous turn: wait for it to end, or send "
                    "`cancel: true` to stop it", HTTPStatus.CONFLICT, "validation", "session_id")


def sessions_full_error(max_sessions: int) -> APIError:
    return APIError(f"all {max_sessions} sessions (--max-sessions) are running a turn: no idle session can be ended "
                    "to make room for a new one", HTTPStatus.TOO_MANY_REQUESTS, "overloaded", "session_id")


def answer_token_ids(request: ClientRequest, encode: Callable[[str], list[int]]) -> list[int] | None:
    """The tokens of a finished turn's answer as the next turn's prompt holds them: its content,
    without the stop or EOS token that ended it (the template's continuation writes the answer's
    end). An answer cut at a stop string is the cut text, tokenized (``encode``): its last tokens
    ran past the cut. None for a turn that did not run to its end (aborted, failed)."""
    reason = request.finish_reason
    ids = request.output_token_ids
    if reason is FinishReason.LENGTH:
        return list(ids)
    if reason is FinishReason.EOS_TOKEN or (reason is FinishReason.STOP_SEQUENCE and ids
                                            and ids[-1] in request.params.stop_token_ids):
        return ids[:-1]
    if reason is FinishReason.STOP_SEQUENCE:
        return encode(request.output_text)
    return None


class SessionStore:
    """The live sessions, least recently used first."""

    def __init__(self, max_sessions: int, idle_timeout: float, end_in_engine: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        if max_sessions < 1:
            raise ValueError(f"--max-sessions must be at least 1, got {max_sessions}")
        if idle_timeout <= 0:
            raise ValueError(f"--session-idle-timeout must be positive, got {idle_timeout}")
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self._end_in_engine = end_in_engine
        self._clock = clock
        self._sessions: OrderedDict[int, Session] = OrderedDict()
        self._next_id = 1
        self._sweeper: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: int) -> bool:
        return session_id in self._sessions

    def new_id(self) -> int:
        """An id no live session has, for a client that sent ``session_id: -1``."""
        while self._next_id in self._sessions:
            self._next_id += 1
        session_id, self._next_id = self._next_id, self._next_id + 1
        return session_id

    def begin_turn(self, session_id: int) -> Session:
        """The session, marked busy for a new turn (opened if it does not exist, ending the least
        recently used idle session if the store is full). A busy session is a 409, a store full
        of busy sessions a 429."""
        session = self._sessions.get(session_id)
        if session is None:
            self._make_room()
            session = self._sessions[session_id] = Session(session_id, last_used=self._clock())
        elif session.busy:
            raise session_busy_error(session_id)
        session.busy = True
        self._sessions.move_to_end(session_id)
        return session

    def end_turn(self, session: Session, prompt_token_ids: list[int] | None, answer_ids: list[int] | None,
                 keep: bool) -> None:
        """A turn is over. A turn that ran to its end (``answer_ids`` not None) extends the
        conversation: its prompt and its answer's content. ``keep`` False ends the session
        (``interactive_mode`` false, or nothing left worth keeping)."""
        session.busy, session.running = False, None
        if session.ended:           # cancelled meanwhile: its tokens are unpinned already
            return
        session.last_used = self._clock()
        if prompt_token_ids is not None and answer_ids is not None:
            session.token_ids = [*prompt_token_ids, *answer_ids]
            session.num_turns += 1
        if not keep or session.num_turns == 0:
            self.end(session.session_id)

    def end(self, session_id: int, reason: str = "the session was ended") -> bool:
        """End a session: stop its running turn (its reader gets ``reason``) and unpin its tokens in
        the engine. False if there was no such session."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        session.ended = True
        if session.running is not None:
            session.running.cancel(reason)     # aborted before the unpin, which then also covers it
        self._end_in_engine(session.engine_id)
        return True

    def expire(self) -> list[int]:
        """End the sessions idle for longer than the timeout; their ids."""
        deadline = self._clock() - self.idle_timeout
        expired = [s.session_id for s in self._sessions.values() if not s.busy and s.last_used < deadline]
        for session_id in expired:
            self.end(session_id)
        return expired

    def _make_room(self) -> None:
        if len(self._sessions) < self.max_sessions:
            return
        idle = next((s for s in self._sessions.values() if not s.busy), None)   # least recently used first
        if idle is None:
            raise sessions_full_error(self.max_sessions)
        self.end(idle.session_id)

    # -- the idle sweep ------------------------------------------------------------------
    def start(self) -> None:
        """Sweep idle sessions on the running event loop, a few times per timeout."""
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="llmserve-session-sweep")

    async def _sweep(self) -> None:
        interval = min(1.0, self.idle_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            self.expire()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
