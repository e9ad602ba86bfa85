"""The engine-core process's module set: token ids in, token ids out, nothing heavy."""

from __future__ import annotations

import subprocess
import sys


def test_the_engine_core_imports_neither_torch_nor_transformers():
    # What `python -m llmserve.engine.core_main` imports, and what its first message brings (a
    # StartEngine, unpickled); a fresh interpreter, since this one has both loaded already.
    code = """
import pickle, sys
import llmserve.engine.core_main, llmserve.engine.core
from llmserve.engine.config import EngineConfig, ModelSpec
from llmserve.engine.messages import StartEngine
pickle.loads(pickle.dumps(StartEngine(EngineConfig()))), pickle.loads(pickle.dumps(ModelSpec("/m", "llama", "cpu", frozenset({2}))))
print(sorted({"torch", "transformers", "tokenizers"} & set(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_end_session_and_a_session_id_reach_the_engine():
    import socket

    from llmserve import SamplingParams
    from llmserve.engine.core import EngineCore
    from llmserve.engine.messages import AddRequest, EndSession

    class Engine:
        def __init__(self):
            self.ended, self.queued = [], []

        def end_session(self, session_id):
            self.ended.append(session_id)

        def enqueue(self, req):
            self.queued.append(req)

    engine, (a, b) = Engine(), socket.socketpair()
    with a, b:
        core = EngineCore(engine, a)
        core._handle(AddRequest(3, [1, 2], SamplingParams(max_new_tokens=1), session_id="chat-1"), core.clients[0])
        core._handle(EndSession("chat-1"), core.clients[0])
        core._executor.shutdown()
    assert [r.session_id for r in engine.queued] == ["chat-1"] and engine.ended == ["chat-1"]



def test_a_ping_is_answered_during_a_step_and_the_rest_waits_for_its_end():
    """/health's ping gets its answer while a long step runs; a request that came with it is
    handled only once the step is done (the engine is never touched by two threads)."""
    import socket

    from llmserve import SamplingParams
    from llmserve.engine.core import EngineCore
    from llmserve.engine.messages import AddRequest, FrameBuffer, Ping, Pong, encode

    class Workers:
        def failure(self):
            return None

    class Engine:
        workers = Workers()

    a, b = socket.socketpair()
    with a, b:
        core = EngineCore(Engine(), a)
        b.sendall(encode([Ping(), AddRequest(3, [1, 2], SamplingParams(max_new_tokens=1))]))

        def step() -> list[object]:
            """A step that lasts until the core has answered (the HTTP process's end reads it)."""
            answers, frames = [], FrameBuffer()
            b.settimeout(30)
            while not answers:
                answers = frames.feed(b.recv(1 << 16))
            return answers

        answers = core._in_thread(step)
        core._executor.shutdown()
    assert [type(m) for m in answers] == [Pong]
    assert [type(m) for _, m in core._inbox] == [AddRequest] and core._inbox[0][1].req_id == 3
