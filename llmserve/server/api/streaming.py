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


def sse_response(events: AsyncIterator[dict[str, Any] | str]) -> EventSourceResponse:
    """One ``data:`` line per item: dicts as JSON, strings as they are (OpenAI's ``[DONE]``)."""

    async def encoded() -> AsyncIterator[dict[str, str]]:
        async with aclosing(events):
            async for item in events:
                yield {"data": item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)}

    return EventSourceResponse(encoded(), sep="\n", shutdown_grace_period=SHUTDOWN_GRACE_S)


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
