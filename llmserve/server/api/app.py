"""The FastAPI application: TGI and OpenAI routes over one router, plus health, info and metrics."""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from llmserve import __version__
from llmserve.server.api import openai, tgi
from llmserve.server.api.errors import APIError, error_response, unauthorized_error, validation_error
from llmserve.server.api.state import ServerState
from llmserve.server.metrics import RequestOutcome


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        await state.engine.close()

    async def require_api_key(request: HTTPRequest) -> None:
        expected = state.config.api_key
        if expected is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise unauthorized_error()

    app = FastAPI(title="llmserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    protected = [Depends(require_api_key)]
    app.include_router(tgi.build_router(state), dependencies=protected)
    app.include_router(openai.build_router(state), dependencies=protected)

    @app.exception_handler(APIError)
    async def on_api_error(request: HTTPRequest, error: APIError) -> JSONResponse:
        if error.status in (HTTPStatus.UNPROCESSABLE_ENTITY, HTTPStatus.NOT_FOUND, HTTPStatus.BAD_REQUEST):
            state.metrics.count(RequestOutcome.VALIDATION_ERROR)
        return error_response(error, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        state.metrics.count(RequestOutcome.VALIDATION_ERROR)
        return error_response(validation_error(describe_validation_error(exc), _first_field(exc)), request.url.path)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.is_healthy:
            return JSONResponse({})
        reason = state.engine.error or "a model worker is not running"
        return JSONResponse({"error": f"unhealthy: {reason}", "error_type": "unhealthy"},
                            status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/info", dependencies=protected)
    async def info() -> dict:
        i = state.info
        lim = state.limits
        return {
            "model_id": state.model_name, "model_path": state.model_path, "model_type": i.model_type,
            "model_dtype": i.dtype, "model_device_type": i.device.split(":")[0], "model_pipeline_tag": "text-generation",
            "num_parameters": i.num_params, "tp": state.engine.engine.config.tp,
            "max_concurrent_requests": lim.max_concurrent_requests, "max_best_of": 1,
            "max_stop_sequences": tgi.MAX_STOP_SEQUENCES, "max_input_tokens": lim.max_input_tokens,
            "max_total_tokens": lim.max_total_tokens, "max_top_n_tokens": lim.max_top_n_tokens,
            "max_batch_prefill_tokens": state.engine.engine.config.max_prefill_tokens,
            "chunked_prefill": state.engine.engine.config.chunked_prefill,
            "kv_cache_tokens": i.max_total_token_num,
            "chat_template": state.chat_template.describe() if state.chat_template else None,
            "router": "llmserve", "version": __version__,
        }

    @app.get("/metrics", dependencies=protected)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.CONTENT_TYPE)

    return app


def describe_validation_error(exc: RequestValidationError) -> str:
    """Pydantic's error list as one readable line: ``body.parameters.top_k: Input should be a valid integer``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
        elif loc:
            parts.append(f"{loc}: {err.get('msg')}")
        else:
            parts.append(str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def _first_field(exc: RequestValidationError) -> str | None:
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            continue   # its loc is ("body", <character offset>): no field is at fault, so no param
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc:
            return loc[0]
    return None
