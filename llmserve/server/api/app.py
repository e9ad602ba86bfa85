"""The FastAPI application: TGI and OpenAI routes over one router, plus health, info and metrics."""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve import __version__
from llmserve.grammar import BACKEND as GRAMMAR_BACKEND
from llmserve.server.api import interactive, lora, openai, tgi, tokenization, ui
from llmserve.server.api.errors import (
    APIError, error_response, http_error, internal_error, not_json_error, validation_error,
)
from llmserve.server.api.middleware import DEFAULT_PAYLOAD_LIMIT, APIKeyMiddleware, BodyLimitMiddleware
from llmserve.server.api.openapi import install_openapi
from llmserve.server.api.state import ServerState
from llmserve.server.metrics import RequestOutcome


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.engine.start()
        state.sessions.start()
        yield
        await state.sessions.close()
        await state.engine.close()

    # /docs and /redoc with their scripts served from the fastapi-offline package, not a CDN:
    # they work where the server has no network (FastAPI's own pages load them from jsDelivr).
    app = FastAPIOffline(title="llmserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    app.include_router(tgi.build_router(state))
    app.include_router(openai.build_router(state))
    app.include_router(interactive.build_router(state))
    app.include_router(tokenization.build_router(state))
    if state.engine.config.allow_runtime_lora_updating:
        app.include_router(lora.build_router(state))
    if state.config.ui:       # GET / (beside TGI's POST /): the chat page; off with --no-ui
        app.include_router(ui.build_router())
    install_openapi(app, api_key_set=state.config.api_key is not None)
    # The last middleware added runs first: the key is checked before the body is even read.
    app.add_middleware(BodyLimitMiddleware, limit=payload_limit(state))
    if state.config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=state.config.api_key,
                           open_pages=ui.PAGE_PATHS if state.config.ui else frozenset())

    @app.exception_handler(APIError)
    async def on_api_error(request: HTTPRequest, error: APIError) -> JSONResponse:
        if error.status in (HTTPStatus.UNPROCESSABLE_ENTITY, HTTPStatus.NOT_FOUND, HTTPStatus.BAD_REQUEST):
            state.metrics.count(RequestOutcome.VALIDATION_ERROR)
        return error_response(error, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        state.metrics.count(RequestOutcome.VALIDATION_ERROR)
        content_type = request.headers.get("content-type")
        if _body_not_an_object(exc) and not _is_json(content_type):
            # FastAPI parses only JSON content types and hands the raw bytes on otherwise
            return error_response(not_json_error(content_type), request.url.path)
        return error_response(validation_error(describe_validation_error(exc), _first_field(exc)), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        """The router's 404 and 405 and FastAPI's body-parse 400, in the API's shape."""
        headers = exc.headers or {}
        detail = str(exc.detail)
        if exc.__cause__ is not None:     # FastAPI's "There was an error parsing the body" hides why
            detail = f"the request body could not be parsed ({' '.join(str(exc.__cause__).split())})"
        allow = next((v for k, v in headers.items() if k.lower() == "allow"), None)
        error = http_error(exc.status_code, detail, request.method, request.url.path, allow)
        if exc.status_code == HTTPStatus.BAD_REQUEST:
            state.metrics.count(RequestOutcome.VALIDATION_ERROR)
        return error_response(error, request.url.path, headers)

    @app.exception_handler(Exception)
    async def on_crash(request: HTTPRequest, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback and re-raises after this answer; clients get the shape.
        return error_response(internal_error(exc), request.url.path)

    @app.get("/health")
    async def health() -> Response:
        reason = await state.engine.unhealthy_reason()
        if reason is None:
            return JSONResponse({})
        return JSONResponse({"error": f"unhealthy: {reason}", "error_type": "unhealthy"},
                            status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/info")
    async def info() -> dict:
        i = state.info
        lim = state.limits
        return {
            "model_id": state.model_name, "model_path": state.model_path, "model_type": i.model_type,
            "model_dtype": i.dtype, "model_device_type": i.device.split(":")[0], "model_pipeline_tag": "text-generation",
            "num_parameters": i.num_params, "tp": state.engine.config.tp, "pp": state.engine.config.pp,
            "dp": state.engine.config.dp,
            # the weights' format ("" for dense: see model_dtype) and bytes, scales included
            "quantization": i.quantization or (f"gguf {i.quantized}" if i.quantized else ""),
            "weight_bytes": i.weight_bytes,
            "max_concurrent_requests": lim.max_concurrent_requests, "max_best_of": lim.max_best_of,
            "max_stop_sequences": tgi.MAX_STOP_SEQUENCES, "max_input_tokens": lim.max_input_tokens,
            "max_total_tokens": lim.max_model_len, "max_top_n_tokens": lim.max_top_n_tokens,
            "max_batch_prefill_tokens": state.engine.config.max_prefill_tokens,
            "chunked_prefill": state.engine.config.chunked_prefill,
            "prefix_cache": state.engine.config.prefix_cache,
            # LoRA adapters served (--lora-modules), selected by adapter_id or an OpenAI `model`
            "lora_adapters": list(state.lora_modules), "max_loras": state.engine.config.max_loras,
            "kv_cache_tokens": i.max_total_token_num, "kv_cache_dtype": i.kv_cache_dtype,
            "cuda_graph_max_bs": i.cuda_graph_max_bs,
            "cuda_graph_verify_bs": i.cuda_graph_verify_bs,
            # prompt-lookup speculation (--speculate; 0: off)
            "speculate": state.engine.config.speculate,
            "speculate_max_batch": state.engine.config.speculate_max_batch,
            "prompt_lookup_ngram": [state.engine.config.prompt_lookup_min_ngram, state.engine.config.prompt_lookup_max_ngram],
            "chat_template": state.chat_template.describe() if state.chat_template else None,
            # image input (image_url parts): whether the model takes images, and how many a request
            "takes_images": state.takes_images, "max_images_per_request": lim.request.max_images,
            # what reads tool calls in answers to tool_choice "auto" (--tool-call-parser, or the template's)
            "tool_call_parser": state.tool_parser.name if state.tool_parser else None,
            # the sampling defaults a request's unset fields take (--generation-config)
            "generation_config": state.sampling_defaults.describe(),
            "grammar_backend": GRAMMAR_BACKEND,   # structured output (response_format, grammar)
            # per data-parallel replica (--dp): generations routed there, in flight, running, waiting, and
            # its prefix cache's looked-up and found prompt tokens
            "replicas": state.engine.replica_states(),
            # which of the --api-server-count HTTP processes answered (the counts above are its own)
            "api_server": {"index": state.config.api_server, "count": state.config.api_server_count, "pid": os.getpid()},
            "router": "llmserve", "version": __version__,
        }

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.CONTENT_TYPE)

    return app


def payload_limit(state: ServerState) -> int:
    limit = state.config.payload_limit
    if limit is None:
        return DEFAULT_PAYLOAD_LIMIT
    if limit < 1:
        raise ValueError(f"--payload-limit must be at least 1 byte, got {limit}")
    return limit


def describe_validation_error(exc: RequestValidationError) -> str:
    """Pydantic's error list as one readable line: ``body.parameters.top_k: Input should be a valid integer``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
        elif loc:
            parts.append(f"{loc}: {err.get('msg')}")
        elif err.get("type") == "missing":      # loc ("body",): no body at all
            parts.append("the request has no body: send a JSON object")
        else:
            parts.append(str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def _body_not_an_object(exc: RequestValidationError) -> bool:
    """The body as a whole is not a JSON object (what FastAPI passes on when it is not JSON)."""
    return any(tuple(err.get("loc", ())) == ("body",) for err in exc.errors())


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _first_field(exc: RequestValidationError) -> str | None:
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            continue   # its loc is ("body", <character offset>): no field is at fault, so no param
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc:
            return loc[0]
    return None
