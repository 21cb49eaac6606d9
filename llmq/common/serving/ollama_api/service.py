"""Ollama's API on the generation service: each route's body translated to the chat,
completion or embedding request that answers it, and the answer to Ollama's objects."""

from __future__ import annotations

import asyncio
import time

from llmq.common.catalogue import keep_alive_seconds
from llmq.common.errors import InvalidRequest
from llmq.common.on_demand import requested_keep_alive
from llmq.common.serving.model_cards import find_model
from llmq.common.serving.ollama_api.chunks import OllamaLines, Surface
from llmq.common.serving.ollama_api.model_facts import model_facts
from llmq.common.serving.ollama_api.models import (
    LoadedList,
    ShowAnswer,
    TagList,
    loaded_model,
    served_engines,
    show_answer,
    tag_model,
)
from llmq.common.serving.ollama_api.objects import Timings
from llmq.common.serving.ollama_api.request import (
    ChatBody,
    EmbedBody,
    GenerateBody,
    GenerationBody,
    LegacyEmbeddingsBody,
    ShowBody,
)
from llmq.common.serving.ollama_api.run import OllamaRun
from llmq.common.serving.ollama_api.translate import chat_request, generate_request
from llmq.common.serving.reasoning import chat_format
from llmq.common.serving.request_bodies import EmbeddingRequest
from llmq.common.serving.responses import WireModel
from llmq.common.serving.service import GenerationService

_LATEST = ":latest"


def keep_alive(body: GenerationBody | EmbedBody) -> float | None:
    """The body's keep_alive in seconds (-1: for good), None where it gives none; 400 for a
    value that is no duration."""
    try:
        return keep_alive_seconds(body.keep_alive, None)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidRequest(str(exc), "keep_alive") from None


class EmbedAnswer(WireModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int = 0
    prompt_eval_count: int


class OllamaService:
    def __init__(self, service: GenerationService):
        self.service = service
        self.registry = service.registry

    async def model_name(self, name: str | None) -> str | None:
        """The served model a name means: Ollama's clients may add the ``:latest`` tag."""
        if name and name.endswith(_LATEST):
            known = await self.registry.known()
            if name not in known and name.removesuffix(_LATEST) in known:
                return name.removesuffix(_LATEST)
        return name

    async def _prepared(self, body: GenerationBody, kind: str = "generate") -> tuple[str, bool]:
        """The body's model resolved (404 if unknown), and whether it has a reasoning parser."""
        body.model = await self.model_name(body.model)
        requested_keep_alive.set(keep_alive(body))
        pipeline, engine = await self.registry.get(body.model, kind)
        body.model = engine.model
        return engine.model, chat_format(pipeline.tokenizer) is not None

    async def _unload(self, surface: Surface, body: GenerationBody) -> WireModel | None:
        """Ollama's answer to nothing to generate with keep_alive 0: the model unloaded (a
        catalogue model's workers unload it once idle); None for any other request."""
        if keep_alive(body) != 0 or not body.model:
            return None
        name = await self.model_name(body.model)
        catalogue = await self.registry.on_demand.catalogue()
        if name not in catalogue:
            return None
        await self.registry.on_demand.unload(name)
        return OllamaLines(surface, name, Timings()).line("", done=True, done_reason="unload")

    def _load(self, surface: Surface, model: str) -> WireModel:
        """Ollama's answer to a request with nothing to generate: the model is loaded."""
        return OllamaLines(surface, model, Timings()).line("", done=True, done_reason="load")

    async def chat(self, body: ChatBody) -> OllamaRun | WireModel:
        timings = Timings()
        if not body.messages and (unloaded := await self._unload("chat", body)):
            return unloaded
        model, reasons = await self._prepared(body)
        if not body.messages:
            return self._load("chat", model)
        generation = await self.service.chat(chat_request(body, reasons))
        timings.mark_submitted()
        return OllamaRun(generation, OllamaLines("chat", generation.model, timings), timings)

    async def generate(self, body: GenerateBody) -> OllamaRun | WireModel:
        timings = Timings()
        if not body.prompt and (unloaded := await self._unload("generate", body)):
            return unloaded
        model, reasons = await self._prepared(body)
        if not body.prompt:
            return self._load("generate", model)
        request = generate_request(body, reasons)
        if body.raw:
            generation = await self.service.completions(request)  # type: ignore[arg-type]
        else:
            generation = await self.service.chat(request)  # type: ignore[arg-type]
        timings.mark_submitted()
        lines = OllamaLines("generate", generation.model, timings)
        return OllamaRun(generation, lines, timings)

    async def _vectors(
        self, model: str | None, inputs: list[str], truncate: bool, dimensions: int | None
    ) -> tuple[str, list[list[float]], int]:
        name = await self.model_name(model)
        if not inputs:  # as Ollama: nothing to embed, once the model is found
            _, engine = await self.registry.get(name, kind="embed")
            return engine.model, [], 0
        request = EmbeddingRequest(
            model=name,
            input=inputs,
            dimensions=dimensions,
            truncate_prompt_tokens=-1 if truncate else None,
        )
        answer = await self.service.embeddings(request)
        vectors = [list(e.embedding) for e in answer.data]  # floats: the default encoding
        return answer.model, vectors, answer.usage.prompt_tokens  # type: ignore[misc]

    async def embed(self, body: EmbedBody) -> EmbedAnswer:
        started = time.monotonic_ns()
        requested_keep_alive.set(keep_alive(body))
        text = body.input
        inputs = ([text] if text else []) if isinstance(text, str) else list(text)
        model, vectors, tokens = await self._vectors(
            body.model, inputs, body.truncate, body.dimensions
        )
        return EmbedAnswer(
            model=model,
            embeddings=vectors,
            total_duration=time.monotonic_ns() - started,
            prompt_eval_count=tokens,
        )

    async def embeddings(self, body: LegacyEmbeddingsBody) -> dict[str, list[float]]:
        """/api/embeddings: one prompt's vector (an empty prompt: an empty vector)."""
        inputs = [body.prompt] if body.prompt else []
        _, vectors, _ = await self._vectors(body.model, inputs, True, None)
        return {"embedding": vectors[0] if vectors else []}

    async def _facts(self) -> list:
        engines = served_engines(await self.registry.engines())
        facts = await asyncio.gather(
            *(asyncio.to_thread(model_facts, e.source or e.model) for e in engines.values())
        )
        return list(zip(engines.values(), facts, strict=True))

    async def tags(self) -> TagList:
        return TagList(models=[tag_model(e, f) for e, f in await self._facts()])

    async def ps(self) -> LoadedList:
        return LoadedList(models=[loaded_model(e, f) for e, f in await self._facts()])

    async def show(self, body: ShowBody) -> ShowAnswer:
        name = await self.model_name(body.model_name())
        if not name:
            raise InvalidRequest("model is required", "model")
        engines = served_engines(await self.registry.engines())
        # 404 for a model not served; a short id or a path names its served model
        engine = engines[find_model(list(engines.values()), name).id]
        name = engine.model
        pipeline, _ = await self.registry.get(name, engine.kind)
        facts = await asyncio.to_thread(model_facts, engine.source or engine.model)
        return show_answer(engine, facts, pipeline.tokenizer)
