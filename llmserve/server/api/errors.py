"""Errors a handler can raise, and the two shapes clients expect them in.

TGI clients read ``{"error": "...", "error_type": "validation"}``; OpenAI clients read
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``. A handler raises one
``APIError``; the app renders it in the shape of the route family it came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from llmserve.sampling_params import InvalidRequest


@dataclass
class APIError(Exception):
    message: str
    status: int = HTTPStatus.UNPROCESSABLE_ENTITY
    error_type: str = "validation"     # TGI's error_type: validation | overloaded | generation | ...
    param: str | None = None            # OpenAI's param: the request field at fault
    openai_code: int | None = None      # OpenAI's status, where it is not the usual mapping of ``status``

    def __str__(self) -> str:
        return self.message

    def tgi_body(self) -> dict[str, Any]:
        return {"error": self.message, "error_type": self.error_type}

    @property
    def openai_status(self) -> int:
        # OpenAI reports invalid parameters as 400 where TGI (and our TGI routes) say 422.
        if self.openai_code is not None:
            return self.openai_code
        return HTTPStatus.BAD_REQUEST if self.status == HTTPStatus.UNPROCESSABLE_ENTITY else self.status

    def openai_body(self) -> dict[str, Any]:
        status = self.openai_status
        return {"error": {"message": self.message, "type": _OPENAI_TYPES.get(status, "server_error"),
                          "param": self.param, "code": int(status)}}


def validation_error(message: str, param: str | None = None) -> APIError:
    return APIError(message, HTTPStatus.UNPROCESSABLE_ENTITY, "validation", param)


def require(condition: bool, message: str, param: str | None = None) -> None:
    """A validation error naming ``param`` unless ``condition`` holds."""
    if not condition:
        raise validation_error(message, param)


@dataclass(frozen=True)
class APIFields:
    """One API's names for the engine's request fields, where they differ (OpenAI's
    ``max_tokens`` for ``max_new_tokens``, TGI's ``inputs`` for ``prompt``): the engine's
    ``InvalidRequest`` becomes this API's validation error, naming this API's field."""
    names: Mapping[str, str] = field(default_factory=dict)
    quote: bool = False                 # TGI's messages put field names in backquotes

    def error(self, e: InvalidRequest) -> APIError:
        return validation_error(e.render(self.names, self.quote), self.names.get(e.field, e.field))


def template_error(message: str, param: str | None = "messages") -> APIError:
    """A well-formed conversation the chat template cannot take (no template, an unknown role,
    longer than its session_len): 422 on both APIs, as TGI's chat route answers template errors."""
    return APIError(message, HTTPStatus.UNPROCESSABLE_ENTITY, "template_error", param,
                    openai_code=HTTPStatus.UNPROCESSABLE_ENTITY)


def overloaded_error() -> APIError:
    return APIError("Model is overloaded", HTTPStatus.TOO_MANY_REQUESTS, "overloaded")


def unauthorized_error() -> APIError:
    return APIError("Unauthorized: pass the server's API key as 'Authorization: Bearer <key>'",
                    HTTPStatus.UNAUTHORIZED, "authentication")


def generation_error(message: str) -> APIError:
    # TGI answers 424 (Failed Dependency) when the model backend fails a request.
    return APIError(message, HTTPStatus.FAILED_DEPENDENCY, "generation")


def model_not_found_error(model: str) -> APIError:
    return APIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "not_found", "model")


def payload_too_large_error(size: int | None, limit: int) -> APIError:
    given = f"Given: {size} bytes" if size is not None else f"Given: more than {limit} bytes"
    return APIError(f"the request body must be at most {limit} bytes (--payload-limit). {given}",
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "validation")


def not_json_error(content_type: str | None) -> APIError:
    # TGI (axum's Json extractor) answers 415 too; curl -d sends form encoding unless told.
    given = f"`{content_type}`" if content_type else "none"
    return APIError(f"the request body must be JSON sent with `Content-Type: application/json`. Given: {given}",
                    HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "validation")


def http_error(status: int, detail: str, method: str, path: str, allow: str | None = None) -> APIError:
    """A Starlette ``HTTPException`` (the router's 404 and 405, FastAPI's body-parse 400) as an
    APIError. A body that cannot be parsed is a validation error like malformed JSON."""
    if status == HTTPStatus.NOT_FOUND:
        return APIError(f"no route `{path}` on this server (see /openapi.json)", status, "not_found")
    if status == HTTPStatus.METHOD_NOT_ALLOWED:
        return APIError(f"{method} is not allowed on `{path}`; it takes {allow or 'other methods'}",
                        status, "method_not_allowed")
    if status == HTTPStatus.BAD_REQUEST:
        return validation_error(detail)
    return APIError(detail, status, "validation" if status < 500 else "internal")


def internal_error(exc: BaseException) -> APIError:
    # No details: a traceback's text is for the server's log, not for clients.
    return APIError(f"internal server error ({type(exc).__name__}); see the server log",
                    HTTPStatus.INTERNAL_SERVER_ERROR, "internal")


_OPENAI_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.CONFLICT: "invalid_request_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: "invalid_request_error",
    HTTPStatus.UNPROCESSABLE_ENTITY: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
}


# vLLM's routes outside /v1 answer errors in OpenAI's shape, as vLLM does.
VLLM_PATHS = frozenset({"/detokenize", "/tokenizer_info"})


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/") or path in VLLM_PATHS


def error_response(error: APIError, path: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """``error`` in the shape of ``path``'s route family; ``headers`` go along (a 405's ``Allow``)."""
    if is_openai_path(path):
        return JSONResponse(error.openai_body(), status_code=error.openai_status, headers=headers)
    return JSONResponse(error.tgi_body(), status_code=error.status, headers=headers)


# -- the shapes as OpenAPI documents them ------------------------------------------------

class TGIErrorBody(BaseModel):
    error: str
    error_type: str


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail
