"""The framing between the HTTP process and the engine core: whatever pieces the socket delivers,
whole messages come out, in order, equal to what went in."""

from __future__ import annotations

import random

from llmserve import SamplingParams
from llmserve.engine.messages import AbortRequests, AddRequest, EngineOutputs, EngineStats, FrameBuffer, encode
from llmserve.engine.request import FinishReason, RequestDelta

MESSAGES = [
    [AddRequest(0, [1, 2, 3], SamplingParams(max_new_tokens=4, stop=["\n"])), AbortRequests([7])],
    EngineOutputs([RequestDelta(0, 42, logprob=-0.5, top_logprobs=[(42, -0.5)],
                                finish_reason=FinishReason.STOP_SEQUENCE, prompt_logprobs=[None, -1.0, -2.0])],
                  EngineStats(num_waiting=1, num_running=2, num_used_slots=30)),
    EngineOutputs(),
]


def test_whole_messages_come_out_of_any_split():
    stream = b"".join(encode(m) for m in MESSAGES)
    rng = random.Random(0)
    for _ in range(20):
        frames, out, i = FrameBuffer(), [], 0
        while i < len(stream):
            n = rng.randint(1, 40)
            out += frames.feed(stream[i:i + n])
            i += n
        assert out == MESSAGES


def test_a_partial_frame_yields_nothing_yet():
    data = encode(MESSAGES[1])
    frames = FrameBuffer()
    assert frames.feed(data[:-1]) == []
    assert frames.feed(data[-1:]) == [MESSAGES[1]]
