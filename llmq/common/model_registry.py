"""Which models the API can serve: those a worker has served (recorded in Redis), each with a
pipeline holding its tokenizer, loaded on first use from the worker's model source."""

from __future__ import annotations

import asyncio
import logging
import time

from llmq.common.engine_status import EngineStatus
from llmq.common.errors import ModelNotFound, ModelNotSupported
from llmq.common.lora_adapters import AdapterRecord
from llmq.common.model_loader import load_tokenizer
from llmq.common.pipeline import TokenGeneratorPipeline
from llmq.common.settings import Settings
from llmq.common.tenants import current_owner
from llmq.common.transport import AsyncTransport

log = logging.getLogger(__name__)


class ModelRegistry:
    def __init__(self, transport: AsyncTransport, settings: Settings):
        self.transport = transport
        self.settings = settings
        self.default_name = settings.served_model_name or settings.model
        self._pipelines: dict[str, TokenGeneratorPipeline] = {}
        self._loading: dict[str, asyncio.Future] = {}
        self._known: tuple[float, dict[str, dict]] = (0.0, {})
        self._adapters: tuple[float, dict[str, AdapterRecord]] = (0.0, {})
        # Engines' heartbeats, shared by all pipelines (one SCAN per second at most).
        self._probe = self._new_pipeline(None, self.default_name)

    def _new_pipeline(self, tokenizer, name: str) -> TokenGeneratorPipeline:
        s = self.settings
        return TokenGeneratorPipeline(
            self.transport,
            tokenizer,
            name,
            max_queue=s.max_queue,
            request_timeout=s.request_timeout,
            inactivity_timeout=s.inactivity_timeout,
            record_ttl=s.request_ttl,
            no_worker_grace=s.no_worker_grace,
            placement=s.placement,
            placement_load_weight=s.placement_load_weight,
        )

    async def engines(self) -> list[EngineStatus]:
        return await self._probe.engines()

    async def known(self) -> dict[str, dict]:
        stamp, known = self._known
        if time.monotonic() - stamp > 2.0:
            known = await self.transport.known_models()
            self._known = (time.monotonic(), known)
        return known

    async def adapters(self, fresh: bool = False) -> dict[str, AdapterRecord]:
        """The LoRA adapters the current tenant (``tenants.current_owner``) may use."""
        stamp, adapters = self._adapters
        if fresh or time.monotonic() - stamp > 2.0:
            adapters = await self.transport.adapters()
            self._adapters = (time.monotonic(), adapters)
        owner = current_owner.get()
        return {n: a for n, a in adapters.items() if a.visible_to(owner)}

    async def adapter(self, name: str) -> AdapterRecord | None:
        """The adapter ``name`` for the current tenant (read again once when not known: one
        loaded through another API process a moment ago)."""
        found = (await self.adapters()).get(name)
        if found is None:
            found = (await self.adapters(fresh=True)).get(name)
        return found

    async def default_model(self) -> str:
        live = {e.model for e in await self.engines()}
        if len(live) == 1 and self.default_name not in live:
            return next(iter(live))
        return self.default_name

    async def get(
        self, name: str | None, kind: str | tuple[str, ...] = "generate"
    ) -> tuple[TokenGeneratorPipeline, EngineStatus]:
        """The pipeline and a live engine for a model: 404 for a model no worker has served,
        503 when its workers are all gone, 400 for the wrong kind of model (``kind``: generate,
        embed or score, or a tuple of those accepted)."""
        name = name or await self.default_model()
        known = await self.known()
        if name not in known:
            known = await self.transport.known_models()
            self._known = (time.monotonic(), known)
        if name not in known:
            adapter = await self.adapter(name)
            if adapter is None:
                raise ModelNotFound(f"the model {name!r} does not exist; see /v1/models", "model")
            pipeline, engine = await self.get(adapter.base, kind)
            return pipeline.for_adapter(adapter), engine
        refused = known[name].get("refused")
        if refused and not any(e.model == name for e in await self.engines()):
            raise ModelNotSupported(f"the model {name!r} is not served: {refused}", "model")
        engine = await self._probe.require_engine(name, kind)
        return await self._pipeline(name, known[name].get("source") or name), engine

    async def preload(self) -> None:
        """Load the default model's tokenizer ahead of the first request (best effort)."""
        try:
            name = await self.default_model()
            known = await self.known()
            if name in known:
                await self._pipeline(name, known[name].get("source") or name)
        except Exception as exc:
            log.debug("tokenizer preload skipped: %s", exc)

    async def _pipeline(self, name: str, source: str) -> TokenGeneratorPipeline:
        pipeline = self._pipelines.get(name)
        if pipeline is not None:
            return pipeline
        future = self._loading.get(name)
        if future is None:
            future = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, source))
            self._loading[name] = future
        try:
            tokenizer = await asyncio.shield(future)
        finally:
            self._loading.pop(name, None)
        pipeline = self._pipelines.setdefault(name, self._new_pipeline(tokenizer, name))
        return pipeline
