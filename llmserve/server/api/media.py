"""Where a request's images come from: ``data:`` URLs and raw base64 (seed 004: "a base64-encoded
jpg", no prefix); ``http(s)://`` URLs only from hosts
the operator named with ``--allowed-media-domains`` (off by default), fetched with a timeout, a
size cap and a redirect limit, every hop's host checked again; and local files only under the
directory the operator named with ``--allowed-local-media-path`` (off by default). A request
field must not make the server read its disk or reach into its network unless an operator said
so. Every failure is the client's: an ``InvalidRequest`` naming the image."""

from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

import httpx

from llmserve.multimodal import ImageLimits
from llmserve.sampling_params import InvalidRequest

# Raw base64 is told from a path by what it decodes to: a string of base64's alphabet whose bytes
# start as an image file does (a JPEG's base64 starts "/9j/", which also reads as a path).
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"RIFF")
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.DOTALL)


@dataclass(frozen=True)
class MediaConfig:
    limits: ImageLimits = field(default_factory=ImageLimits)
    allowed_local_media_path: str | None = None   # None: no local files
    # Hosts a request's http(s) image URLs may name (and redirect to); "*": any; empty: none.
    allowed_media_domains: frozenset[str] = frozenset()
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3


async def load_image_bytes(url: str, config: MediaConfig) -> bytes:
    """The encoded image ``url`` names."""
    if url.startswith("data:"):
        return _data_url_bytes(url, config)
    raw = _raw_base64_bytes(url, config)
    if raw is not None:
        return raw
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https"):
        return await _fetch(url, config)
    if scheme == "file" or (not scheme and url.startswith("/")):
        return _read_local(unquote(urlparse(url).path) if scheme == "file" else url, config)
    raise InvalidRequest("image", "an image must be a data: URL, raw base64 of a jpg/png, an http(s):// URL "
                                  "(where --allowed-media-domains allows its host), or a file:// URL or absolute "
                                  "path (under --allowed-local-media-path)")


def _raw_base64_bytes(text: str, config: MediaConfig) -> bytes | None:
    """The image a bare base64 string holds; None if it is not one (then it is a URL or a path)."""
    if len(text) % 4 or not _BASE64.fullmatch(text):
        return None
    if len(text) > config.limits.max_bytes * 4 // 3 + 4:
        raise InvalidRequest("image", f"an image may have at most {config.limits.max_bytes} bytes")
    data = base64.b64decode(text)   # cannot fail: the alphabet and length are checked
    return data if data.startswith(_IMAGE_MAGIC) else None


def _data_url_bytes(url: str, config: MediaConfig) -> bytes:
    m = _DATA_URL.fullmatch(url)
    if m is None:
        raise InvalidRequest("image", "a data: image URL must be data:image/<type>;base64,<data>")
    data = m.group("data")
    if len(data) > config.limits.max_bytes * 4 // 3 + 4:
        raise InvalidRequest("image", f"an image may have at most {config.limits.max_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("image", "a data: image URL holds invalid base64") from None


def _check_host(url: str | httpx.URL, config: MediaConfig) -> None:
    host = (url.host if isinstance(url, httpx.URL) else urlparse(url).hostname) or ""
    allowed = config.allowed_media_domains
    if not allowed:
        raise InvalidRequest("image", "image URLs are not fetched: the server was started without "
                                      "--allowed-media-domains (send the image as a data: URL)")
    if "*" not in allowed and host.lower() not in allowed:
        raise InvalidRequest("image", f"the image host {host!r} is not among the server's --allowed-media-domains")


async def _fetch(url: str, config: MediaConfig) -> bytes:
    cap = config.limits.max_bytes
    _check_host(url, config)

    async def check_hop(request: httpx.Request) -> None:   # every redirect's target too
        _check_host(request.url, config)

    try:
        async with httpx.AsyncClient(follow_redirects=True, max_redirects=config.max_redirects,
                                     timeout=config.fetch_timeout_s, trust_env=False,
                                     event_hooks={"request": [check_hop]}) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidRequest("image", f"fetching the image {url} failed: HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > cap:
                    raise InvalidRequest("image", f"the image {url} has {declared} bytes; at most {cap} are allowed")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > cap:
                        raise InvalidRequest("image", f"the image {url} has more than {cap} bytes")
                return bytes(body)
    except httpx.TooManyRedirects:
        raise InvalidRequest("image", f"fetching the image {url} took more than {config.max_redirects} redirects") from None
    except httpx.TimeoutException:
        raise InvalidRequest("image", f"fetching the image {url} timed out ({config.fetch_timeout_s:g} s)") from None
    except httpx.HTTPError as e:
        raise InvalidRequest("image", f"the image {url} could not be fetched: {type(e).__name__}") from None


def _read_local(path: str, config: MediaConfig) -> bytes:
    root = config.allowed_local_media_path
    if root is None:
        raise InvalidRequest("image", "local image files are not allowed: the server was started without "
                                      "--allowed-local-media-path")
    # Resolved with symlinks followed, both sides: neither `..` nor a link may leave the directory.
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise InvalidRequest("image", f"the image path {path} is outside the allowed local media directory")
    try:
        size = os.path.getsize(real)
        if size > config.limits.max_bytes:
            raise InvalidRequest("image", f"the image {path} has {size} bytes; at most {config.limits.max_bytes} are allowed")
        with open(real, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidRequest("image", f"the image {path} cannot be read: {e.strerror or type(e).__name__}") from None
