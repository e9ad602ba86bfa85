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


# -- several HTTP processes (--api-server-count) -------------------------------------------

def test_each_http_process_gets_its_own_requests_and_one_hanging_up_costs_only_its_own(tiny_llama_dir):
    """One engine core, two connections: the launcher's EngineClient (even request ids) and a raw
    socket standing for HTTP process 1 (odd ids). Each connection gets its own requests' deltas
    and no other's; an abort from one cannot touch the other's request; when one hangs up, its
    request is aborted and the other's runs to its end; the launcher's close stops the core."""
    import asyncio
    import socket
    import threading

    from llmserve import LLM, SamplingParams
    from llmserve.engine.core import EngineCore
    from llmserve.engine.messages import AbortRequests, AddRequest, EngineOutputs, EngineReady, FrameBuffer, encode
    from llmserve.server.engine_client import EngineClient

    prompt = [1, 422, 3456, 17, 905]
    short = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    long = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    with LLM(tiny_llama_dir, max_total_token_num=2048) as llm:
        expected = llm.generate([prompt], short)[0].token_ids
        engine = llm.engine
        (launcher, core_0), (other, core_1) = socket.socketpair(), socket.socketpair()
        core = threading.Thread(target=EngineCore(engine, core_0, core_1).run, name="test-engine-core")
        core.start()
        other.settimeout(30)
        frames = FrameBuffer()

        def read_other() -> list[EngineOutputs]:
            """What the core sent HTTP process 1 by now (at least one message)."""
            messages = frames.feed(other.recv(1 << 20))
            while not messages:
                messages = frames.feed(other.recv(1 << 20))
            return messages

        async def main() -> tuple[list[int], list[int], list[int]]:
            ready = EngineReady(engine.info, engine.config, engine.model, engine.summary())
            client = EngineClient(launcher, ready, llm.tokenizer, api_server=0, api_server_count=2)
            await client.start()
            try:
                mine = client.generate(prompt, long)         # id 0
                events = aiter(mine)
                first = await anext(events)                  # request 0 runs in the core now
                other.sendall(encode([AddRequest(1, prompt, short), AbortRequests([mine.req_id])]))
                theirs, seen_ids = [], set()
                while len(theirs) < len(expected):
                    for outputs in await asyncio.to_thread(read_other):
                        seen_ids |= {delta.req_id for delta in outputs.deltas}
                        theirs += [delta.token_id for delta in outputs.deltas]
                assert seen_ids == {1}, seen_ids               # never request 0's deltas
                # HTTP process 1 starts a long request, then hangs up mid-way
                other.sendall(encode([AddRequest(3, prompt, long)]))
                while not any(d.req_id == 3 for outputs in await asyncio.to_thread(read_other) for d in outputs.deltas):
                    pass
                other.close()
                mine_tokens = [first.token_id] + [event.token_id async for event in events]
                return theirs, mine_tokens, list(engine.requests)
            finally:
                await client.close()

        try:
            theirs, mine_tokens, left = asyncio.run(asyncio.wait_for(main(), 60))
        finally:
            core.join(timeout=30)
            core_0.close()
            core_1.close()
        assert not core.is_alive(), "the engine core did not stop on the launcher's Shutdown"
        assert theirs == expected
        assert len(mine_tokens) == 200 and mine_tokens[:8] == expected    # the other's abort did not reach it
        assert left == [], left                                           # request 3 went with its process
