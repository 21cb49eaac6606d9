"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, in vLLM's shapes: a LoRA adapter
offered (or withdrawn) at run time, to the key that loaded it where several keys are set."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from llmq.common.serving.adapters import (
    LoadAdapterRequest,
    UnloadAdapterRequest,
    load_adapter,
    unload_adapter,
)

router = APIRouter()


def _multi_tenant(request: Request) -> bool:
    return len(request.app.state.api_keys) > 1


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadAdapterRequest, request: Request) -> str:
    return await load_adapter(request.app.state.registry, body, _multi_tenant(request))


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadAdapterRequest, request: Request) -> str:
    return await unload_adapter(request.app.state.registry, body, _multi_tenant(request))
