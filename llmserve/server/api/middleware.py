"""What every HTTP request passes before any route sees it: the API key, then the body size.

Both are pure ASGI middleware rather than FastAPI dependencies, because a dependency runs only
after FastAPI has read, parsed and validated the body: a client without the key would learn
from a 422 what the body should look like, and a huge body would be parsed before any size
check. Here the key is checked on the headers alone, and the body is counted as it arrives.
Refusals are written in the shape of the route family the path belongs to (``errors.py``).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.server.api.errors import APIError, error_response, payload_too_large_error, unauthorized_error
from llmserve.server.api.schema import MAX_INPUT_CHARS

# Seed 004 allows a prompt of up to 4 MiB characters. In JSON one character can take 6 bytes:
# `requests`-based clients (text_generation among them) escape every non-ASCII character as
# \uXXXX (a character beyond the BMP is a surrogate pair there, two characters as UTF-16 counts
# them). Raw UTF-8 takes at most 4. So 6 bytes a character, plus 1 MiB for the rest of the body
# (parameters, stop strings, chat structure): 25 MiB. TGI's own default (--payload-limit
# 2,000,000) would refuse an ASCII prompt half the seed's size.
DEFAULT_PAYLOAD_LIMIT = 6 * MAX_INPUT_CHARS + 1024 * 1024

# The one path a load balancer must reach without the key.
OPEN_PATHS = frozenset({"/health"})


async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send,
                  headers: dict[str, str] | None = None) -> None:
    await error_response(error, scope["path"], headers)(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value
    return None


class APIKeyMiddleware:
    """With a key set, every path but /health (the docs and /openapi.json included) needs
    ``Authorization: Bearer <key>``; without it the request gets a 401 before its body is read.
    ``open_pages``: paths a GET may fetch without the key, the chat page's files (``ui.py``): a
    browser opening a URL sends no header, and the page then sends the key with each API call."""

    def __init__(self, app: ASGIApp, api_key: str, open_pages: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_pages = open_pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.open(scope) or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        await _refuse(unauthorized_error(), scope, receive, send)

    def open(self, scope: Scope) -> bool:
        # GET only: POST / is TGI's generate route, which needs the key like any other
        return scope["path"] in OPEN_PATHS or (scope["method"] == "GET" and scope["path"] in self.open_pages)

    def authorized(self, scope: Scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        # compare_digest takes as long whatever the token, so timing tells nothing of the key
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)


class BodyLimitMiddleware:
    """Refuse (413) a request body over ``limit`` bytes: at once by its Content-Length, else by
    counting the bytes of a chunked body as they arrive. The body is read ahead of the app, which
    so sees only bodies within the limit; no more than ``limit`` bytes of one are ever held."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await _refuse(payload_too_large_error(declared, self.limit), scope, receive, send)
            return
        messages = await self._read_body(receive)
        if messages is None:
            # A chunked body may never end: close the connection rather than let the HTTP
            # server read on (and throw away) whatever the client still sends. A body with
            # a Content-Length is bounded by it, and the client gets to read its 413 whole.
            await _refuse(payload_too_large_error(None, self.limit), scope, receive, send, {"Connection": "close"})
            return
        await self.app(scope, _replay(messages, receive), send)

    async def _read_body(self, receive: Receive) -> list[Message] | None:
        """The request's body messages, up to the last one or a disconnect; None past the limit."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.limit:
                return None
            if not message.get("more_body", False):
                return messages


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None     # the HTTP server refuses a malformed Content-Length itself


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives back the messages read ahead, then the client's own (a disconnect)."""
    pending = list(reversed(messages))

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
