"""Which models the API can serve: those a worker has served (recorded in Redis), each with a
pipeline holding its tokenizer, loaded on first use from the worker's model source (the default
model's ahead of the first request). A model answers to its served name, its short id
(``smollm2-135m-instruct``) and its source's path or hub id (``common/model_ids``)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from llmq.common.catalogue import keep_alive_seconds
from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import InvalidRequest, ModelNotFound, ModelNotSupported, Unavailable
from llmq.common.lora_adapters import AdapterRecord
from llmq.common.model_files import load_tokenizer
from llmq.common.model_ids import alias_candidates, resolve_alias
from llmq.common.on_demand import OnDemand
from llmq.common.settings import Settings
from llmq.common.tenants import current_owner
from llmq.common.transport import AsyncTransport

log = logging.getLogger(__name__)


class ModelRegistry:
    def __init__(self, transport: AsyncTransport, settings: Settings):
        self.transport = transport
        self.settings = settings
        self.default_name = settings.served_name
        self._pipelines: dict[str, TokenGeneratorPipeline] = {}
        self._loading: dict[str, asyncio.Future] = {}
        self._known: tuple[float, dict[str, dict]] = (0.0, {})
        self._adapters: tuple[float, dict[str, AdapterRecord]] = (0.0, {})
        keep = keep_alive_seconds(settings.keep_alive, 300.0)
        self.on_demand = OnDemand(transport.r, transport.keys, keep, settings.request_timeout)
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
        self,
        name: str | None,
        kind: str | tuple[str, ...] = "generate",
        keep_alive: float | None = None,
    ) -> tuple[TokenGeneratorPipeline, EngineStatus]:
        """The pipeline and a live engine for a model: 404 for a model no worker has served,
        503 when its workers are all gone, 400 for the wrong kind of model (``kind``: generate,
        embed or score, or a tuple of those accepted). A catalogue model no worker holds is
        loaded first (``keep_alive``: how long it stays loaded after this request)."""
        name = name or await self.default_model()
        known = await self.known()
        if name not in known:
            known = await self.transport.known_models()
            self._known = (time.monotonic(), known)
        catalogue = await self.on_demand.catalogue()
        if name not in known and name not in catalogue:
            adapter = await self.adapter(name)
            if adapter is not None:
                pipeline, engine = await self.get(adapter.base, kind)
                return pipeline.for_adapter(adapter), engine
            name = await self._alias(name, {**catalogue, **known})
        if name in catalogue:
            return await self._on_demand(name, catalogue[name]["source"], kind, keep_alive)
        refused = known[name].get("refused")
        if refused and not any(e.model == name for e in await self.engines()):
            raise ModelNotSupported(f"the model {name!r} is not served: {refused}", "model")
        engine = await self._probe.require_engine(name, kind)
        return await self._pipeline(name, known[name].get("source") or name), engine

    async def _on_demand(
        self, name: str, source: str, kind, keep_alive: float | None
    ) -> tuple[TokenGeneratorPipeline, EngineStatus]:
        """A catalogue model's pipeline and engine, loaded by a worker first where none holds
        it (the API's tokenizer loads meanwhile)."""
        await self.on_demand.keep(name, keep_alive)
        # Fresh, not the second-old cache: a model unloaded within it would take the request
        # into a stream no worker reads, to fail once no_worker_grace runs out.
        if any(e.model == name for e in await self._probe.engines(max_age=0.0)):
            return await self._pipeline(name, source), await self._probe.require_engine(name, kind)
        pipeline = asyncio.ensure_future(self._ready_pipeline(name, source))
        try:
            engine = await self.on_demand.load(name, self._probe, kind)
        except BaseException:
            pipeline.cancel()
            raise
        return await pipeline, engine

    async def _ready_pipeline(self, name: str, source: str) -> TokenGeneratorPipeline:
        """The pipeline with its tokenizer's profile read, while a worker loads the model, so
        the first request does not pay for it (docs/performance.md, "Models on demand: the
        first request's wait")."""
        pipeline = await self._pipeline(name, source)
        await pipeline.encoder.profile()
        return pipeline

    async def _alias(self, name: str, known: dict[str, dict]) -> str:
        """The served model a short id or a source names; 404 for none, 400 for several."""
        live = {e.model for e in await self.engines()}
        name = name.removesuffix(":latest")  # Ollama's clients add the tag to any name
        served = resolve_alias(name, known, live)
        if served is not None:
            return served
        candidates = alias_candidates(name, known)
        if candidates:
            raise InvalidRequest(
                f"the model {name!r} may mean any of {', '.join(candidates)}: name one", "model"
            )
        loading = {r["model"]: r for r in await self.loading()}
        meant = name if name in loading else resolve_alias(name, loading)
        if meant is not None:
            waited = time.time() - loading[meant]["since"]
            raise Unavailable(
                f"the model {meant!r} is loading (for {waited:.0f} s so far); retry shortly"
            )
        raise ModelNotFound(f"the model {name!r} does not exist; see /v1/models", "model")

    async def loading(self) -> list[dict]:
        """The models workers are loading and serve on no live worker yet: one record each
        (``model``, ``source``, ``since``), from the workers' announcements whose time has not
        run out (a worker that died loading leaves one that does)."""
        raw = await self.transport.r.hgetall(self.transport.keys.loading)
        now, live = time.time(), {e.model for e in await self.engines()}
        found: dict[str, dict] = {}
        stale = []
        for worker, value in raw.items():
            try:
                record = json.loads(value)
                expired = record["until"] <= now
                record["source"], record["since"] = str(record["source"]), float(record["since"])
            except (ValueError, KeyError, TypeError):  # not a worker's record: not listed
                continue
            if expired:  # its worker died loading (a killed one withdraws nothing)
                stale.append(worker)
            elif record["model"] not in live:
                found.setdefault(record["model"], record)
        if stale:
            await self.transport.r.hdel(self.transport.keys.loading, *stale)
        return sorted(found.values(), key=lambda r: r["model"])

    async def preload(self) -> None:
        """Load the default model's tokenizer ahead of the first request (best effort): from
        the source its workers recorded, or, before any has, from this process's LLMQ_MODEL
        where that is a local path (`llmq up`: the API starts beside a loading worker)."""
        try:
            name = await self.default_model()
            known = await self.known()
            source = known.get(name, {}).get("source")
            if source is None and name == self.default_name and Path(self.settings.model).exists():
                source = self.settings.model
            if source is not None:
                started = time.monotonic()
                await self._pipeline(name, source)
                log.info(
                    "load phase: the API's tokenizer of %s ready in %.2f s",
                    name,
                    time.monotonic() - started,
                )
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
