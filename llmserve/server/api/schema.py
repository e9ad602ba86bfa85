"""What every request body shares before any route looks at it: strict JSON types, finite
numbers, real Unicode, and the bounds both APIs apply.

Pydantic's lax mode would take ``false`` as token 0, ``"5"`` as 5 and ``1e20`` as an int, and
Python's JSON parser reads ``Infinity``, ``NaN`` and ``1e999`` as floats: none of those is what
a client meant, so request models are strict and reject non-finite floats. A lone UTF-16
surrogate (``"\\ud800"`` in JSON) parses into a Python ``str`` that cannot be encoded as UTF-8,
so it would fail deep inside the tokenizer; it is refused here, wherever it sits in the body.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from llmserve.server.api.errors import validation_error

# Seed 004: a prompt is at most 4 MB of characters.
MAX_INPUT_CHARS = 4 * 1024 * 1024
# Seed 004's stop list: at most 1024 sequences of 1 to 1024 characters, 32768 characters in all
# (both APIs take the same list).
MAX_STOP_SEQUENCES = 1024
MAX_STOP_LENGTH = 1024
MAX_STOP_TOTAL_CHARS = 32768


class APIModel(BaseModel):
    """Base of every request body model."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        where = find_lone_surrogate(data)
        if where is not None:
            # a dict key on the path may hold the surrogate itself: escape it for the message
            where = where.encode("utf-8", "backslashreplace").decode()
            field = where or "the request"
            raise validation_error(f"`{field}` contains a lone UTF-16 surrogate, which is not valid Unicode text",
                                   where.split(".")[0] if where else None)
        return data


def find_lone_surrogate(value: Any) -> str | None:
    """The dotted path of the first string (or dict key) holding a lone surrogate, else None.

    Iterative, not recursive: a body may nest as deep as the JSON parser goes, deeper than
    Python's recursion limit leaves room for below the framework's own frames."""
    pending: list[tuple[Any, str]] = [(value, "")]
    while pending:
        item, path = pending.pop()
        if isinstance(item, str):
            if _has_lone_surrogate(item):
                return path
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                inner = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and _has_lone_surrogate(key):
                    return inner
                children.append((child, inner))
            pending.extend(reversed(children))     # first field first
        elif isinstance(item, list):
            pending.extend(reversed([(child, f"{path}.{i}" if path else str(i)) for i, child in enumerate(item)]))
    return None


def _has_lone_surrogate(text: str) -> bool:
    # JSON joins an escaped *pair* into one code point, so any surrogate left is a lone one.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class ImageURL(APIModel):
    """OpenAI's image reference, ``{"url": ...}`` (media.py says which URLs a server takes)."""
    model_config = ConfigDict(extra="ignore")   # OpenAI's `detail` means nothing here

    url: str


def image_url_of(value: str | ImageURL) -> str:
    """An image part's URL, whichever form it came in: a bare string (seed 004's TGI ``inputs``)
    or OpenAI's object."""
    return value if isinstance(value, str) else value.url


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def check_stop(stop: list[str], param: str = "stop") -> None:
    if len(stop) > MAX_STOP_SEQUENCES:
        raise validation_error(f"`{param}` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(stop)}",
                               param)
    if not all(1 <= len(s) <= MAX_STOP_LENGTH for s in stop):
        raise validation_error(f"each `{param}` sequence must have 1 to {MAX_STOP_LENGTH} characters", param)
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_TOTAL_CHARS:
        raise validation_error(f"`{param}` sequences must have at most {MAX_STOP_TOTAL_CHARS} characters in all. "
                               f"Given: {total}", param)
