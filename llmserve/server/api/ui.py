"""The chat page: ``GET /`` and its script and style sheet, static files shipped in the package
(``llmserve/server/ui/``), so that a browser is all a user needs to try the model.

The page itself is served without the API key (it holds no secret and a browser cannot send a
header when it opens a URL); every API call the page makes carries the key (``chat.js``). Its
Content-Security-Policy lets it load and fetch from this server only: nothing on it can reach
another host, whatever a model writes into an answer.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

UI_DIR = Path(__file__).resolve().parent.parent / "ui"

# URL path -> (file in UI_DIR, media type)
PAGE_FILES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/ui/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(PAGE_FILES)

# data: images are the user's own uploads, shown in the conversation before they are sent
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
           "Cache-Control": "no-cache"}


def build_router() -> APIRouter:
    """GET routes for the page's files, read once here (a missing file fails the start-up)."""
    router = APIRouter()
    for path, (name, media_type) in PAGE_FILES.items():
        router.add_api_route(path, _file_route((UI_DIR / name).read_bytes(), media_type), methods=["GET"],
                             include_in_schema=False)
    return router


def _file_route(content: bytes, media_type: str):
    async def serve_file() -> Response:
        return Response(content, media_type=media_type, headers=HEADERS)
    return serve_file
