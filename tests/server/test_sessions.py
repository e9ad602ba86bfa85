"""The interactive session store (server/sessions.py) on its own: turns, LRU room-making, busy
sessions, the idle timeout, what ending tells the engine, and which tokens an answer leaves in
the history."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import pytest

from llmserve.engine.request import FinishReason
from llmserve.output import ClientRequest
from llmserve.sampling_params import SamplingParams
from llmserve.server.api.errors import APIError
from llmserve.server.sessions import SessionStore, answer_token_ids


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeStream:
    def __init__(self) -> None:
        self.cancelled: str | None = None

    def cancel(self, message: str) -> None:
        self.cancelled = message


@pytest.fixture
def ended() -> list[str]:
    return []


@pytest.fixture
def clock() -> Clock:
    return Clock()


def store(ended: list[str], clock: Clock, max_sessions: int = 2, idle_timeout: float = 10.0) -> SessionStore:
    return SessionStore(max_sessions, idle_timeout, ended.append, clock)


def one_turn(sessions: SessionStore, session_id: int, prompt: list[int], answer: list[int]) -> None:
    session = sessions.begin_turn(session_id)
    sessions.end_turn(session, prompt, answer, keep=True)


def test_a_turn_extends_the_history(ended, clock):
    sessions = store(ended, clock)
    one_turn(sessions, 5, [1, 2, 3], [4, 5])
    session = sessions.begin_turn(5)
    assert session.token_ids == [1, 2, 3, 4, 5] and session.num_turns == 1
    sessions.end_turn(session, [1, 2, 3, 4, 5, 6], [7], keep=True)
    assert session.token_ids == [1, 2, 3, 4, 5, 6, 7] and session.num_turns == 2
    assert ended == []


def test_a_turn_that_did_not_finish_leaves_the_history(ended, clock):
    sessions = store(ended, clock)
    one_turn(sessions, 5, [1, 2], [3])
    session = sessions.begin_turn(5)
    sessions.end_turn(session, [1, 2, 3, 9], None, keep=True)     # aborted: no answer
    assert session.token_ids == [1, 2, 3] and 5 in sessions and not session.busy


def test_a_first_turn_that_did_not_finish_ends_the_session(ended, clock):
    sessions = store(ended, clock)
    session = sessions.begin_turn(5)
    sessions.end_turn(session, [1, 2], None, keep=True)
    assert 5 not in sessions and ended == ["5"]


def test_a_last_turn_ends_the_session(ended, clock):
    sessions = store(ended, clock)
    one_turn(sessions, 5, [1], [2])
    session = sessions.begin_turn(5)
    sessions.end_turn(session, [1, 2, 3], [4], keep=False)
    assert 5 not in sessions and ended == ["5"]


def test_a_busy_session_refuses_another_turn(ended, clock):
    sessions = store(ended, clock)
    sessions.begin_turn(5)
    with pytest.raises(APIError) as e:
        sessions.begin_turn(5)
    assert e.value.status == HTTPStatus.CONFLICT and e.value.param == "session_id"


def test_a_new_session_ends_the_least_recently_used_idle_one(ended, clock):
    sessions = store(ended, clock)
    one_turn(sessions, 1, [1], [2])
    clock.now = 1
    one_turn(sessions, 2, [1], [2])
    clock.now = 2
    one_turn(sessions, 1, [1, 2, 3], [4])     # 1 is now the most recently used
    one_turn(sessions, 3, [1], [2])
    assert ended == ["2"] and 1 in sessions and 3 in sessions


def test_busy_sessions_are_never_ended_for_room(ended, clock):
    sessions = store(ended, clock)
    sessions.begin_turn(1)
    one_turn(sessions, 2, [1], [2])
    sessions.begin_turn(3)                    # ends 2, the only idle one
    assert ended == ["2"]
    with pytest.raises(APIError) as e:
        sessions.begin_turn(4)
    assert e.value.status == HTTPStatus.TOO_MANY_REQUESTS and 1 in sessions and 3 in sessions


def test_idle_sessions_expire(ended, clock):
    sessions = store(ended, clock, idle_timeout=10)
    one_turn(sessions, 1, [1], [2])
    clock.now = 5
    one_turn(sessions, 2, [1], [2])
    busy = sessions.begin_turn(2)
    clock.now = 10.5
    assert sessions.expire() == [1] and ended == ["1"]
    clock.now = 100
    assert sessions.expire() == []            # 2 is running a turn
    sessions.end_turn(busy, [1, 2, 3], [4], keep=True)
    clock.now = 110.5
    assert sessions.expire() == [2]


def test_the_sweeper_ends_idle_sessions(ended):
    async def run() -> None:
        sessions = SessionStore(4, 0.05, ended.append)
        sessions.start()
        one_turn(sessions, 1, [1], [2])
        await asyncio.sleep(0.3)
        await sessions.close()
        assert 1 not in sessions

    asyncio.run(run())
    assert ended == ["1"]


def test_ending_cancels_the_running_turn(ended, clock):
    sessions = store(ended, clock)
    one_turn(sessions, 1, [1], [2])
    session = sessions.begin_turn(1)
    session.running = stream = FakeStream()
    assert sessions.end(1, "cancelled")
    assert stream.cancelled == "cancelled" and ended == ["1"] and session.ended
    sessions.end_turn(session, [1, 2, 3], None, keep=True)    # the cancelled turn's own end changes nothing
    assert 1 not in sessions and ended == ["1"]
    assert not sessions.end(1)


def test_new_ids_skip_live_sessions(ended, clock):
    sessions = store(ended, clock, max_sessions=4)
    one_turn(sessions, 1, [1], [2])
    one_turn(sessions, 2, [1], [2])
    assert sessions.new_id() == 3
    assert sessions.new_id() == 4


def finished(output: list[int], reason: FinishReason, text: str = "", stop_token_ids: tuple[int, ...] = ()):
    request = ClientRequest(0, [1, 2], SamplingParams(stop_token_ids=list(stop_token_ids)), detokenizer=None)
    request.output_token_ids, request.finish_reason, request.output_text = list(output), reason, text
    return request


def test_answer_tokens():
    def encode(text):
        return [ord(c) for c in text]
    # an answer cut by its length keeps every token
    assert answer_token_ids(finished([7, 8, 9], FinishReason.LENGTH), encode) == [7, 8, 9]
    # EOS and a stop token end the answer without being its content (the continuation writes the end)
    assert answer_token_ids(finished([7, 8, 2], FinishReason.EOS_TOKEN), encode) == [7, 8]
    assert answer_token_ids(finished([7, 8, 5], FinishReason.STOP_SEQUENCE, stop_token_ids=(5,)), encode) == [7, 8]
    # a stop string cuts the text inside a token: the cut text, tokenized
    assert answer_token_ids(finished([7, 8, 9], FinishReason.STOP_SEQUENCE, text="ab"), encode) == [97, 98]
    assert answer_token_ids(finished([7], FinishReason.ABORT), encode) is None
    assert answer_token_ids(finished([], None), encode) is None


def test_bad_bounds_are_refused(ended):
    with pytest.raises(ValueError, match="--max-sessions"):
        SessionStore(0, 10, ended.append)
    with pytest.raises(ValueError, match="--session-idle-timeout"):
        SessionStore(1, 0, ended.append)
