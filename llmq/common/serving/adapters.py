"""Loading and unloading LoRA adapters at run time (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``): the registry (``Keys.loras``) offers an adapter to every API
process and worker; a worker reads its weights when a request first names it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from llmq.common.engine_client.model_registry import ModelRegistry
from llmq.common.errors import InvalidRequest, LLMQError, NotFound
from llmq.common.lora_adapters import AdapterError, AdapterRecord, check_adapter
from llmq.common.tenants import current_owner


class PermissionDenied(LLMQError):
    status = 403
    type = "permission_error"
    code = "permission_denied"


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    # Which served model the adapter applies to; unset: the default model.
    base_model: str | None = None
    load_inplace: bool = False  # vLLM's: replace an adapter of that name


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name decides here


def _base_config(source: str) -> dict | None:
    """The base model's config.json where it can be read here (a local folder, or the hub's
    cache); None where not (its shapes are then checked by the worker alone)."""
    file = Path(source) / "config.json"
    if not file.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(source, "config.json")
        except Exception:
            return None
        if not isinstance(cached, str):
            return None
        file = Path(cached)
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    # A multimodal config keeps the language model's shapes in text_config.
    return config.get("text_config", config) if isinstance(config, dict) else None


async def load_adapter(registry: ModelRegistry, body: LoadAdapterRequest, multi_tenant: bool):
    """Offer the adapter, checked first: nothing is registered for one a worker could not
    apply. ``multi_tenant``: several API keys, so the adapter is its loader's alone."""
    name = body.lora_name
    if name != name.strip() or any(c.isspace() or c in "{}" for c in name):
        raise InvalidRequest(f"lora_name {name!r}: no spaces or braces", "lora_name")
    base = body.base_model or await registry.default_model()
    known = await registry.transport.known_models()
    if name in known:
        raise InvalidRequest(f"{name!r} is the name of a model", "lora_name")
    if base not in known:
        raise NotFound(f"the base model {base!r} does not exist; see /v1/models", "base_model")
    await registry.get(base)  # 503 with no live worker, 400 for an embedding model
    existing = (await registry.transport.adapters()).get(name)
    if existing is not None and not (
        body.load_inplace and existing.visible_to(current_owner.get())
    ):
        raise InvalidRequest(
            f"The lora adapter '{name}' has already been loaded.", "lora_name", "lora_exists"
        )
    source = known[base].get("source") or base
    try:
        config = await asyncio.to_thread(_base_config, source)
        info = await asyncio.to_thread(
            check_adapter, body.lora_path, config, registry.settings.max_lora_rank
        )
    except AdapterError as exc:
        raise InvalidRequest(str(exc), "lora_path", "invalid_lora_adapter") from None
    owner = current_owner.get() if multi_tenant else ""
    record = AdapterRecord(name, base, body.lora_path, owner, info.rank, int(time.time()))
    if existing is not None:
        await registry.transport.remove_adapter(name)
    if not await registry.transport.add_adapter(record):
        raise InvalidRequest(
            f"The lora adapter '{name}' has already been loaded.", "lora_name", "lora_exists"
        )
    await registry.adapters(fresh=True)
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_adapter(registry: ModelRegistry, body: UnloadAdapterRequest, multi_tenant: bool):
    """Withdraw an adapter: requests that name it from now on get a 404; those running finish
    (workers drop its weights as they need the room)."""
    name = body.lora_name
    record = (await registry.adapters(fresh=True)).get(name)
    if record is None:
        raise NotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")
    if multi_tenant and not record.owner:
        raise PermissionDenied(
            f"the adapter {name!r} is configured at start (LLMQ_LORA_MODULES); it is not "
            "unloaded through the API where several keys are set"
        )
    await registry.transport.remove_adapter(name)
    await registry.adapters(fresh=True)
    return f"Success: LoRA adapter '{name}' removed successfully."
