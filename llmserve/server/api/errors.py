"""Errors a handler can raise, and the two shapes clients expect them in.

TGI clients read ``{"error": "...", "error_type": "validation"}``; OpenAI clients read
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``. A handler raises one
``APIError``; the app renders it in the shape of the route family it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse


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


_OPENAI_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.UNPROCESSABLE_ENTITY: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
}


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def error_response(error: APIError, path: str) -> JSONResponse:
    if is_openai_path(path):
        return JSONResponse(error.openai_body(), status_code=error.openai_status)
    return JSONResponse(error.tgi_body(), status_code=error.status)
