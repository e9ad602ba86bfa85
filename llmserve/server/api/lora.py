"""vLLM's run-time LoRA routes, served with ``--allow-runtime-lora-updating`` only (off, no request
can make the server read a path): ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``
(a local PEFT adapter directory) and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``."""

from __future__ import annotations

import os
from http import HTTPStatus

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from llmserve.server.api.errors import APIError, generation_error, require
from llmserve.server.api.schema import APIModel
from llmserve.server.api.state import ServerState
from llmserve.server.engine_client import EngineError


class LoadLoraRequest(APIModel):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(APIModel):
    lora_name: str


def build_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    async def update(name: str, path: str | None) -> None:
        try:
            answer = await state.engine.update_lora(name, path)
        except EngineError as e:
            raise generation_error(str(e)) from None
        if answer.not_found:
            raise APIError(answer.error, HTTPStatus.NOT_FOUND, "not_found", "lora_name")
        require(answer.error is None, answer.error or "", "lora_path" if path is not None else "lora_name")

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoraRequest):
        require(body.lora_name != "" and body.lora_name not in state.model_names,
                "lora_name must be a name other than the base model's", "lora_name")
        require(os.path.isabs(body.lora_path) and os.path.isdir(body.lora_path),
                "lora_path must be an absolute path to a local adapter directory", "lora_path")
        await update(body.lora_name, body.lora_path)
        state.lora_modules[body.lora_name] = body.lora_path
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraRequest):
        await update(body.lora_name, None)
        state.lora_modules.pop(body.lora_name, None)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return router
