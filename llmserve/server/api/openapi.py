"""/openapi.json with the statuses the routes really answer, each with its error body's schema.

FastAPI documents only 200 and its own 422 (``{"detail": [...]}``, a shape this server never
sends). Here each operation lists the errors of its route family in that family's shape, and,
with an API key, the 401 and the bearer scheme (so /docs offers its "Authorize" button).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from llmserve.server.api.errors import OpenAIErrorBody, TGIErrorBody, is_openai_path
from llmserve.server.api.middleware import OPEN_PATHS

_WHY = {
    HTTPStatus.BAD_REQUEST: "Invalid request: a field out of range, of the wrong type, or malformed JSON",
    HTTPStatus.UNAUTHORIZED: "Missing or wrong `Authorization: Bearer <key>` (only with --api-key)",
    HTTPStatus.NOT_FOUND: "The request names a model this server does not serve",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "The body is larger than --payload-limit bytes",
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: "The body is not sent as `Content-Type: application/json`",
    HTTPStatus.UNPROCESSABLE_ENTITY: "Invalid request (TGI routes), or a conversation the chat template refuses",
    HTTPStatus.CONFLICT: "The interactive session is still running its previous turn",
    HTTPStatus.NOT_IMPLEMENTED: "Interactive sessions are off: the server runs several HTTP processes (--api-server-count)",
    HTTPStatus.FAILED_DEPENDENCY: "The engine failed the generation (a worker died, the server is shutting down)",
    HTTPStatus.TOO_MANY_REQUESTS: "Overloaded: --max-concurrent-requests generations are in flight",
    HTTPStatus.SERVICE_UNAVAILABLE: ("Unhealthy: a model worker or the engine core died, failed on the device or hung, "
                                     "or the engine core does not answer"),
}

_BODY = [HTTPStatus.REQUEST_ENTITY_TOO_LARGE, HTTPStatus.UNSUPPORTED_MEDIA_TYPE, HTTPStatus.UNPROCESSABLE_ENTITY]
_GENERATION = [HTTPStatus.FAILED_DEPENDENCY, HTTPStatus.TOO_MANY_REQUESTS]

# The errors of each route, besides the 401 every route but /health has when a key is set.
ROUTE_ERRORS: dict[str, list[HTTPStatus]] = {
    "/generate": _BODY + _GENERATION,
    "/generate_stream": _BODY + _GENERATION,
    "/": _BODY + _GENERATION,
    "/tokenize": [HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND] + _BODY,   # TGI's body: 422; vLLM's: 400 / 404
    "/detokenize": [HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND, HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    HTTPStatus.UNSUPPORTED_MEDIA_TYPE],
    "/v1/models/{model_id}": [HTTPStatus.NOT_FOUND],
    "/v1/completions": [HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND] + _BODY + _GENERATION,
    "/v1/chat/completions": [HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND] + _BODY + _GENERATION,
    "/v1/chat/interactive": [HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND, HTTPStatus.CONFLICT,
                             HTTPStatus.NOT_IMPLEMENTED] + _BODY + _GENERATION,
    "/health": [HTTPStatus.SERVICE_UNAVAILABLE],
    # --allow-runtime-lora-updating only
    "/v1/load_lora_adapter": [HTTPStatus.BAD_REQUEST, HTTPStatus.FAILED_DEPENDENCY] + _BODY,
    "/v1/unload_lora_adapter": [HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND, HTTPStatus.FAILED_DEPENDENCY] + _BODY,
}


# Statuses a TGI-family route answers in OpenAI's shape: /tokenize's vLLM bodies (tokenization.py).
OPENAI_SHAPED: dict[str, frozenset[HTTPStatus]] = {"/tokenize": frozenset({HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND})}


def install_openapi(app: FastAPI, api_key_set: bool) -> None:
    """Replace ``app.openapi`` with one that documents the real errors (built once, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = document_errors(schema, api_key_set)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document_errors(schema: dict[str, Any], api_key_set: bool) -> dict[str, Any]:
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for model in (TGIErrorBody, OpenAIErrorBody):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
    if api_key_set:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema.get("paths", {}).items():
        body_model = OpenAIErrorBody if is_openai_path(path) else TGIErrorBody
        statuses = list(ROUTE_ERRORS.get(path, []))
        if api_key_set and path not in OPEN_PATHS:
            statuses.append(HTTPStatus.UNAUTHORIZED)
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)      # FastAPI's {"detail": [...]}: never sent here
            for status in sorted(statuses):
                model = OpenAIErrorBody if status in OPENAI_SHAPED.get(path, ()) else body_model
                responses[str(int(status))] = _response(status, model.__name__)
            if api_key_set and path not in OPEN_PATHS:
                operation["security"] = [{"bearer": []}]
    _drop_unused(schemas, schema["paths"], ["HTTPValidationError", "ValidationError"])
    return schema


def _response(status: HTTPStatus, model_name: str) -> dict[str, Any]:
    return {"description": _WHY.get(status, status.phrase),
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model_name}"}}}}


def _drop_unused(schemas: dict[str, Any], paths: dict[str, Any], names: list[str]) -> None:
    """Remove FastAPI's validation-error schemas once no operation refers to them."""
    text = repr(paths) + repr({k: v for k, v in schemas.items() if k not in names})
    for name in names:
        if f"#/components/schemas/{name}" not in text:
            schemas.pop(name, None)
