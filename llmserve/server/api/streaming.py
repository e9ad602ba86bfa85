"""Server-sent events: how every streaming route writes its events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from sse_starlette import EventSourceResponse

from llmserve.server.engine_client import EngineError, RequestStream, TokenEvent

# On shutdown the server first ends every stream with an error event; this is how long those
# streams get to send it before the connection is cut.
SHUTDOWN_GRACE_S = 2.0


class _EventStream(EventSourceResponse):
    """sse_starlette's response without a cancel scope around every event's send: it opens one
    (``move_on_after(send_timeout)``) even with no timeout, as ours is: one a token. With this and
    `sse_event`'s bytes the SSE layer takes 6.3 us an event against 16.6 (benchmarks/README.md,
    "The HTTP process's CPU per streamed token"). With a timeout set, sse_starlette's own send runs."""

    async def _send_with_timeout(self, send, message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def sse_event(item: dict[str, Any] | str) -> bytes:
    """One ``data:`` event: a dict as JSON, a string as it is (OpenAI's ``[DONE]``). Neither holds
    a line break (JSON escapes them), so the event is one line."""
    return b"data: " + (item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)).encode() + b"\n\n"


def sse_response(events: AsyncIterator[dict[str, Any] | str]) -> EventSourceResponse:
    """One ``data:`` event per item, encoded here as bytes (sse_starlette sends bytes as they are;
    a dict would be rebuilt as its ``ServerSentEvent`` for every token)."""

    async def encoded() -> AsyncIterator[bytes]:
        async with aclosing(events):
            async for item in events:
                yield sse_event(item)

    return _EventStream(encoded(), sep="\n", shutdown_grace_period=SHUTDOWN_GRACE_S)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The events of several streams (OpenAI's n > 1, or several prompts) as they come, each
    tagged with its stream's index. Raises ``EngineError`` if the engine fails."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | EngineError | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((index, event))
        except EngineError as e:
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, EngineError):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
