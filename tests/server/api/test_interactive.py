"""``POST /v1/chat/interactive`` end to end: a 5-turn session's answers against the same
conversation sent whole to /v1/chat/completions (the embedded model, greedy, its own Jinja
template); streaming and the session rules (session_len, a busy session, cancel,
--max-sessions, bad input) on the tiny model with a JSON (registry ChatML) template."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving_utils import ServerProcess

QUESTIONS = ["What is the capital of France?", "And of Germany?", "Which of the two cities is bigger?",
             "Name a river in the first one.", "Thank you!"]
GREEDY = {"temperature": 0, "request_output_len": 10}   # short: some answers end on EOS, some on the length
SESSION_LEN = 160      # the tiny server's JSON template


def turn(client: httpx.Client, session_id: int, prompt, interactive: bool = True, **fields) -> dict:
    r = client.post("/v1/chat/interactive", json={"session_id": session_id, "prompt": prompt,
                                                  "interactive_mode": interactive, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def refused(client: httpx.Client, status: int, body: dict) -> dict:
    r = client.post("/v1/chat/interactive", json=body)
    assert r.status_code == status, r.text
    return r.json()["error"]


def streamed(client: httpx.Client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/interactive", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line]


@pytest.fixture(scope="module")
def embedded(embedded_server) -> httpx.Client:
    with httpx.Client(base_url=embedded_server.url, timeout=120) as client:
        yield client


def test_a_session_answers_as_the_whole_conversation(embedded):
    answers = []
    for k, question in enumerate(QUESTIONS):
        answers.append(turn(embedded, 4242, question, interactive=k < len(QUESTIONS) - 1, **GREEDY))
    # interactive_mode false ended it: the id starts a new session
    assert turn(embedded, 4242, "", cancel=True)["tokens"] == 0

    def whole(k: int) -> dict:
        conversation = []
        for question, got in zip(QUESTIONS[:k], answers):
            conversation += [{"role": "user", "content": question}, {"role": "assistant", "content": got["text"]}]
        conversation.append({"role": "user", "content": QUESTIONS[k]})
        return embedded.post("/v1/chat/completions", json={"messages": conversation, "temperature": 0,
                                                           "max_tokens": GREEDY["request_output_len"]}).json()

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:      # the engine batches them
        wholes = list(pool.map(whole, range(len(QUESTIONS))))
    history = 0
    for got, reference in zip(answers, wholes):
        assert got["text"] == reference["choices"][0]["message"]["content"]
        assert got["finish_reason"] == reference["choices"][0]["finish_reason"]
        # the session's prompt is the whole conversation's, as long
        assert got["history_tokens"] == history
        assert got["history_tokens"] + got["input_tokens"] == reference["usage"]["prompt_tokens"]
        assert got["tokens"] == reference["usage"]["completion_tokens"]
        # the history: the prompt and the answer's content (an EOS ends it and is not content)
        history = got["history_tokens"] + got["input_tokens"] + got["tokens"] - (got["finish_reason"] == "stop")
    # a later turn prefills its new tokens only: the cache holds the rest (but for an answer cut
    # by its length, whose last token no step fed)
    for previous, got in zip(answers, answers[1:]):
        assert got["cached_tokens"] == got["history_tokens"] - (previous["finish_reason"] == "length")


# -- the rules, on the tiny model -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_sessions_server(tiny_llama_dir, tmp_path_factory) -> ServerProcess:
    template = tmp_path_factory.mktemp("interactive") / "chatml.json"
    template.write_text(json.dumps({"model_name": "chatml", "session_len": SESSION_LEN}))
    with ServerProcess(tiny_llama_dir, "--chat-template", str(template), "--max-sessions", "2") as server:
        yield server


@pytest.fixture(scope="module")
def tiny(tiny_sessions_server) -> httpx.Client:
    with httpx.Client(base_url=tiny_sessions_server.url, timeout=60) as client:
        yield client


def test_a_streamed_turn(tiny):
    first = turn(tiny, -1, "hi", request_output_len=4, temperature=0)
    session_id = first["session_id"]
    body = {"session_id": session_id, "prompt": "more", "interactive_mode": True, "request_output_len": 8,
            "temperature": 0}
    lines = streamed(tiny, body)
    assert all(line["session_id"] == session_id and line["history_tokens"] > 0 for line in lines)
    assert [line["finish_reason"] for line in lines[:-1]] == [None] * (len(lines) - 1)
    assert lines[-1]["finish_reason"] in ("stop", "length")
    # the same two turns, not streamed, in a session of their own
    other = turn(tiny, -1, "hi", request_output_len=4, temperature=0)
    assert other["session_id"] != session_id
    again = turn(tiny, other["session_id"], "more", interactive=False, request_output_len=8, temperature=0)
    assert "".join(line["text"] for line in lines) == again["text"]
    assert lines[-1]["tokens"] == again["tokens"]
    turn(tiny, session_id, "", cancel=True)


def test_session_len_bounds_the_session(tiny):
    error = refused(tiny, 422, {"session_id": 1, "prompt": "hi", "request_output_len": SESSION_LEN})
    assert error["param"] == "request_output_len" and "session_len" in error["message"]
    turn(tiny, 1, "hi", request_output_len=40, ignore_eos=True, temperature=0)
    got = turn(tiny, 1, "more", request_output_len=40, ignore_eos=True, temperature=0)
    history = got["history_tokens"] + got["input_tokens"] + 40
    assert history + 10 + 60 > SESSION_LEN
    error = refused(tiny, 422, {"session_id": 1, "prompt": "more", "interactive_mode": True, "request_output_len": 60})
    assert "session_len" in error["message"]
    # the refused turn left the session as it was
    assert turn(tiny, 1, "x", request_output_len=1)["history_tokens"] == history


def test_an_ended_session_keeps_only_what_others_share_cached(tiny):
    unique = " ".join(f"word{i}" for i in range(30))
    first = turn(tiny, 30, unique, request_output_len=8, ignore_eos=True)
    # A one-off chat whose prompt starts as the session's: the cache holds their common part.
    while_alive = turn(tiny, -1, unique + " and more", interactive=False, request_output_len=1)
    common = while_alive["cached_tokens"]
    assert common >= first["input_tokens"] - 6
    turn(tiny, 30, "more", interactive=False, request_output_len=8, ignore_eos=True)     # ends the session
    # Ended: the session's own tokens are gone, the part the one-off chat shares stays.
    again = turn(tiny, -1, unique, interactive=False, request_output_len=1)
    assert again["cached_tokens"] == common


def lmdeploy_body(prompt: str, session_id: int, interactive_mode: bool = False, stream: bool = False,
                  request_output_len: int | None = None, cancel: bool | None = None) -> dict:
    """What LMDeploy's ``APIClient.chat_interactive_v1`` (0.9, the last release with sessions)
    posts: every argument of the call, its defaults and its empty ``kwargs`` included. Its
    ``chat`` sends interactive turns, its ``end_session`` an empty prompt with no output; its
    gradio front-end cancels with ``cancel``."""
    body = {"prompt": prompt, "image_url": None, "session_id": session_id, "interactive_mode": interactive_mode,
            "stream": stream, "stop": None, "request_output_len": request_output_len, "top_p": 0.8, "top_k": 40,
            "temperature": 0.8, "repetition_penalty": 1.0, "ignore_eos": False, "skip_special_tokens": True,
            "adapter_name": None, "kwargs": {}}
    return body if cancel is None else body | {"cancel": cancel}


def lmdeploy_post(client: httpx.Client, body: dict) -> list[dict]:
    """As the client reads an answer, streamed or not: the body's non-empty lines, each JSON."""
    with client.stream("POST", "/v1/chat/interactive", json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def cached_slots(server: ServerProcess, until: int | None = None) -> int:
    """The cache gauge, read until it shows ``until`` (the engine reports it after the change)."""
    for _ in range(50):
        value = int(server.metrics()["llmserve_kv_cache_slots_cached"])
        if until is None or value == until:
            return value
        time.sleep(0.1)
    return value


def test_lmdeploy_clients_open_continue_and_end_a_session(tiny, tiny_sessions_server):
    before = cached_slots(tiny_sessions_server)
    session_id = 777
    histories = []
    for k, prompt in enumerate(["Hi there", "Tell me more", "And then?"]):
        lines = lmdeploy_post(tiny, lmdeploy_body(prompt, session_id, interactive_mode=True, stream=k != 1,
                                                   request_output_len=6))
        assert lines[-1]["finish_reason"] in ("stop", "length") and lines[-1]["session_id"] == session_id
        histories.append(lines[-1]["history_tokens"])
    assert histories[0] == 0 < histories[1] < histories[2]
    assert cached_slots(tiny_sessions_server) > before           # the conversation is held for its next turn
    [ended] = lmdeploy_post(tiny, lmdeploy_body("", session_id, request_output_len=0))      # end_session
    assert ended == {"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0, "finish_reason": "stop",
                     "session_id": session_id, "cached_tokens": 0}
    assert cached_slots(tiny_sessions_server, until=before) == before
    # the id starts afresh
    lines = lmdeploy_post(tiny, lmdeploy_body("Hi there", session_id, interactive_mode=True, request_output_len=2))
    assert lines[-1]["history_tokens"] == 0
    # the gradio front-end's stop: a cancel with an empty prompt ends it too
    stopped = lmdeploy_post(tiny, lmdeploy_body("", session_id, interactive_mode=True, request_output_len=0,
                                                cancel=True))
    assert stopped == [ended]
    assert cached_slots(tiny_sessions_server, until=before) == before


def test_a_busy_session_and_cancel(tiny):
    body = {"session_id": 2, "prompt": "hi", "interactive_mode": True, "request_output_len": 100, "ignore_eos": True}
    with tiny.stream("POST", "/v1/chat/interactive", json={**body, "stream": True}) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines))["finish_reason"] is None
        error = refused(tiny, 409, {**body, "prompt": "again"})
        assert error["param"] == "session_id" and "previous turn" in error["message"]
        assert turn(tiny, 2, "", cancel=True)["tokens"] == 0
        rest = [json.loads(line) for line in lines if line]
    assert "cancel" in rest[-1]["error"]["message"]
    # the cancelled session is gone: its id starts afresh
    assert turn(tiny, 2, "hi", request_output_len=1)["history_tokens"] == 0


def test_max_sessions_ends_the_least_recently_used(tiny):
    for session_id in (10, 11):
        turn(tiny, session_id, "hi", request_output_len=2)
    assert turn(tiny, 10, "again", request_output_len=2)["history_tokens"] > 0   # 10 is now the most recent
    turn(tiny, 12, "hi", request_output_len=2)                                  # ends 11
    assert turn(tiny, 10, "again", request_output_len=2, interactive=False)["history_tokens"] > 0
    assert turn(tiny, 11, "hi", request_output_len=2, interactive=False)["history_tokens"] == 0


@pytest.mark.parametrize("body, status, param", [
    ({"session_id": -2, "prompt": "hi"}, 400, "session_id"),
    ({"session_id": True, "prompt": "hi"}, 400, "session_id"),
    ({"session_id": -1, "prompt": "hi", "cancel": True}, 400, "session_id"),
    ({"session_id": 3, "prompt": ""}, 400, "prompt"),
    ({"session_id": 3, "prompt": []}, 400, "prompt"),
    ({"session_id": 3, "prompt": [{"role": "robot", "content": "hi"}]}, 422, "prompt"),
    ({"session_id": 3, "prompt": "hi", "n": 2}, 400, "n"),
    ({"session_id": 3, "prompt": "hi", "request_output_len": 0}, 400, "request_output_len"),
    ({"session_id": 3, "prompt": "hi", "top_p": 2.0}, 400, "top_p"),
    ({"session_id": 3, "prompt": "hi", "image_url": "data:image/png;base64,AAAA"}, 400, "image_url"),
])
def test_bad_input(tiny, body, status, param):
    error = refused(tiny, status, body)
    assert error["param"] == param
    assert turn(tiny, 3, "hi", request_output_len=1)["history_tokens"] == 0    # no session was left behind
    turn(tiny, 3, "", cancel=True)
