"""The tokenizer's routes: ``POST /tokenize`` (TGI's body or vLLM's), ``POST /detokenize`` and
``GET /tokenizer_info`` (vLLM's), so that clients such as lm-evaluation-harness can use the
served model's tokenizer remotely instead of loading one of their own.

``/tokenize`` is one route for two APIs: a body with ``inputs`` is TGI's (a list of tokens with
their character spans; errors in TGI's shape), one with ``prompt`` or ``messages`` is vLLM's
(``{"count", "max_model_len", "tokens", "token_strs"}``; errors in OpenAI's shape, as vLLM).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Body
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, ValidationError

from llmserve.server.api import tgi
from llmserve.server.api.errors import APIError, validation_error
from llmserve.server.api.openai.convert import chat_messages, check_model
from llmserve.server.api.openai.schema import ChatCompletionRequest
from llmserve.server.api.schema import APIModel
from llmserve.server.api.state import ServerState
from llmserve.server.metrics import RequestOutcome


class VLLMTokenizeFields(APIModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    return_token_strs: bool = False


class TokenizePromptRequest(VLLMTokenizeFields):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(ChatCompletionRequest):
    """A chat request's fields (so the conversation is read exactly as /v1/chat/completions reads
    it), plus vLLM's tokenize options; only what that route does with a conversation is served."""
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(APIModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def _openai_error(state: ServerState, error: APIError) -> JSONResponse:
    """An error of a vLLM-shaped body on a TGI-family path: OpenAI's shape, as vLLM answers."""
    if error.status in (HTTPStatus.UNPROCESSABLE_ENTITY, HTTPStatus.NOT_FOUND, HTTPStatus.BAD_REQUEST):
        state.metrics.count(RequestOutcome.VALIDATION_ERROR)
    return JSONResponse(error.openai_body(), status_code=error.openai_status)


def _body_error(e: ValidationError) -> APIError:
    """A vLLM body's pydantic errors, worded as the app words every other body's."""
    from llmserve.server.api.app import describe_validation_error   # app imports this module

    locations = [err["loc"] for err in e.errors() if err.get("loc")]
    return validation_error(describe_validation_error(RequestValidationError(e.errors())),
                            str(locations[0][0]) if locations else None)


def tokenizer_info(state: ServerState) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's class, its special tokens and chat template."""
    tok = state.tokenizer
    template = state.chat_template
    jinja = getattr(template.template, "source", None) if template is not None else None
    return {
        "tokenizer_class": type(tok).__name__,
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token, "unk_token": tok.unk_token,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "model_max_length": state.limits.max_model_len,
        "chat_template": jinja or None,          # a registry template has no Jinja text to give
        "vocab_size": state.info.vocab_size,
    }


async def vllm_tokenize(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    if "messages" in body:
        request: TokenizePromptRequest | TokenizeChatRequest = TokenizeChatRequest.model_validate(body)
        check_model(state, request.model)
        if not request.add_generation_prompt or request.continue_final_message:
            raise validation_error("only add_generation_prompt=true and continue_final_message=false are "
                                   "supported: the prompt /v1/chat/completions would run", "add_generation_prompt")
        # the prompt chat/completions would run: image placeholders expanded (the images are not fetched)
        messages, _ = chat_messages(request.messages)
        ids = state.expand_images(await state.tokenize_in_thread(state.encode_chat, messages))
    else:
        request = TokenizePromptRequest.model_validate(body)
        check_model(state, request.model)
        ids = await state.tokenize_in_thread(state.encode, request.prompt, "prompt", request.add_special_tokens, False)
    return {"count": len(ids), "max_model_len": state.limits.max_model_len, "tokens": ids,
            "token_strs": state.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None}


def decode(state: ServerState, token_ids: list[int]) -> str:
    """On a tokenizer thread (``ServerState.tokenize_in_thread``): a long list stays off the event
    loop. An id of the model's vocabulary that the tokenizer lacks (a padded vocabulary) is the
    client's error, as a text the tokenizer refuses is."""
    try:
        return state.thread_tokenizer.decode(token_ids)
    except Exception as e:
        raise validation_error(f"`tokens` could not be decoded: {e}", "tokens") from None


def body_schema(model: type[APIModel]) -> dict[str, Any]:
    """A body model's JSON schema for /openapi.json, inline; the models it refers to (TGIParameters,
    ChatMessage, ...) are in the document's components already, through the other routes' bodies."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    return schema


def build_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"oneOf": [body_schema(m) for m in (tgi.TokenizeRequest, TokenizePromptRequest, TokenizeChatRequest)]}}}}})
    async def tokenize(body: dict[str, Any] = Body(...)):
        if "inputs" in body or not ("prompt" in body or "messages" in body):
            try:
                return await tgi.tokenize(state, tgi.TokenizeRequest.model_validate(body))
            except ValidationError as e:
                raise RequestValidationError(e.errors()) from None
        try:
            return await vllm_tokenize(state, body)
        except ValidationError as e:
            return _openai_error(state, _body_error(e))
        except APIError as e:
            return _openai_error(state, e)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(state, body.model)
        vocab = state.info.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise validation_error(f"`tokens` must be in [0, {vocab})", "tokens")
        return {"prompt": await state.tokenize_in_thread(decode, state, body.tokens)}

    @router.get("/tokenizer_info")
    async def get_tokenizer_info():
        return tokenizer_info(state)

    return router
