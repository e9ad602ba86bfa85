"""streaming.py: the bytes of a server-sent event stream."""

from __future__ import annotations

import json

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from llmserve.server.api.streaming import sse_event, sse_response


def test_an_event_is_one_data_line_whatever_its_text_holds():
    item = {"token": {"text": "a\nb\r\u2028é\"}"}, "generated_text": None}
    event = sse_event(item)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    line = event[len(b"data: "):-2]
    assert b"\n" not in line and b"\r" not in line          # SSE ends a line at CR or LF
    assert json.loads(line) == item
    assert "é".encode() in line                            # not escaped: ensure_ascii=False
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"


def test_a_response_sends_each_item_as_its_event_in_order():
    items = [{"index": i, "text": f"t{i}"} for i in range(3)] + ["[DONE]"]

    async def events():
        for item in items:
            yield item

    async def endpoint(request):
        return sse_response(events())

    with TestClient(Starlette(routes=[Route("/s", endpoint)])) as client:
        r = client.get("/s")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content == b"".join(sse_event(item) for item in items)
