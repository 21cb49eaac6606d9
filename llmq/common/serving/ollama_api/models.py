"""The served models in Ollama's shapes: /api/tags (the list), /api/ps (what is loaded: every
served model, for as long as its workers run), /api/show (one model's template, details, facts
and capabilities). Answered from the live workers' heartbeats and the model's files."""

from __future__ import annotations

import hashlib
from typing import Any

from llmq.common.engine_status import EngineStatus
from llmq.common.serving.ollama_api.model_facts import (
    ModelFacts,
    parameter_size,
    quantization_level,
)
from llmq.common.serving.ollama_api.objects import rfc3339
from llmq.common.serving.reasoning import chat_format
from llmq.common.serving.responses import WireModel
from llmq.common.serving.tool_parsers import choose_format
from llmq.common.settings import get_settings

# A served model stays loaded while its workers run: Ollama's "forever" (keep_alive < 0).
LOADED_UNTIL = "2318-01-01T00:00:00Z"
# The Ollama release whose API this one follows (clients check it for features like think).
OLLAMA_VERSION = "0.12.0"


class ModelDetails(WireModel):
    parent_model: str = ""
    format: str = "safetensors"
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class TagModel(WireModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class TagList(WireModel):
    models: list[TagModel]


class LoadedModel(TagModel):
    expires_at: str
    size_vram: int
    context_length: int


class LoadedList(WireModel):
    models: list[LoadedModel]


class ShowAnswer(WireModel):
    license: str = ""
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


def served_engines(engines: list[EngineStatus]) -> dict[str, EngineStatus]:
    """One engine per served model (its earliest started), by model name, sorted."""
    first: dict[str, EngineStatus] = {}
    for e in sorted(engines, key=lambda e: (e.model, e.started)):
        first.setdefault(e.model, e)
    return first


def details(engine: EngineStatus, facts: ModelFacts) -> ModelDetails:
    family = facts.family or ("bert" if engine.kind == "embed" else "")
    return ModelDetails(
        family=family,
        families=[family] if family else [],
        parameter_size=parameter_size(facts.parameter_count),
        quantization_level=quantization_level(engine.dtype),
    )


def _digest(engine: EngineStatus) -> str:
    return hashlib.sha256(f"{engine.model}\n{engine.source}".encode()).hexdigest()


def tag_model(engine: EngineStatus, facts: ModelFacts) -> TagModel:
    return TagModel(
        name=engine.model,
        model=engine.model,
        modified_at=rfc3339(engine.started),
        size=facts.size_bytes,
        digest=_digest(engine),
        details=details(engine, facts),
    )


def loaded_model(engine: EngineStatus, facts: ModelFacts) -> LoadedModel:
    on_gpu = engine.device.startswith("cuda")
    return LoadedModel(
        **tag_model(engine, facts).model_dump(exclude={"details"}),
        details=details(engine, facts),
        expires_at=LOADED_UNTIL,
        size_vram=facts.size_bytes if on_gpu else 0,
        context_length=engine.max_model_len,
    )


def capabilities(engine: EngineStatus, tokenizer) -> list[str]:
    if engine.kind == "embed":
        return ["embedding"]
    found = ["completion"]
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    if template and choose_format(get_settings().tool_parser, template) is not None:
        found.append("tools")
    if chat_format(tokenizer) is not None:
        found.append("thinking")
    if engine.images:
        found.append("vision")
    return found


def _model_info(engine: EngineStatus, facts: ModelFacts) -> dict[str, Any]:
    arch = facts.family or "llmq"
    config = facts.config
    info: dict[str, Any] = {"general.architecture": arch, "general.basename": engine.model}
    if facts.parameter_count:
        info["general.parameter_count"] = facts.parameter_count
    info[f"{arch}.context_length"] = engine.max_model_len
    keys = {
        "embedding_length": "hidden_size",
        "block_count": "num_hidden_layers",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "feed_forward_length": "intermediate_size",
    }
    for name, key in keys.items():
        if isinstance(config.get(key), int):
            info[f"{arch}.{name}"] = config[key]
    if engine.vocab_size:
        info[f"{arch}.vocab_size"] = engine.vocab_size
    return info


def show_answer(engine: EngineStatus, facts: ModelFacts, tokenizer) -> ShowAnswer:
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    parameters = f"num_ctx {engine.max_model_len}"
    modelfile = (
        "# Served by llmq: the operator's model (it cannot be changed through this API)\n"
        f"FROM {engine.source or engine.model}\n"
        f'TEMPLATE """{template}"""\n'
        f"PARAMETER {parameters}\n"
    )
    return ShowAnswer(
        modelfile=modelfile,
        parameters=parameters,
        template=template,
        details=details(engine, facts),
        model_info=_model_info(engine, facts),
        capabilities=capabilities(engine, tokenizer),
        modified_at=rfc3339(engine.started),
    )
