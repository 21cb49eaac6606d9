"""The API's side of models on demand (``common/catalogue``): the catalogue workers published,
a request for a model no worker holds waiting for a worker to load it, keep-alives and unloads
asked for."""

from __future__ import annotations

import asyncio
import json
import time
from contextvars import ContextVar

from llmq.common.catalogue import FAILED_LOAD_HOLD_S, decode, fresh_residents, holders
from llmq.common.engine_client.deadline import current_deadline
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import LLMQError
from llmq.common.transport import Keys

# The keep_alive the request being handled gave (Ollama's routes), for every model lookup it
# makes: a route looks its model up more than once, and each lookup sets the keep-alive.
requested_keep_alive: ContextVar[float | None] = ContextVar("requested_keep_alive", default=None)

POLL_S = 0.05  # how often a waiting request looks for its model's engine
REWISH_S = 2.0  # a wish written again this often while its request waits
CATALOGUE_CACHE_S = 2.0


class ModelLoadFailed(LLMQError):
    """The model's files could not be loaded (a corrupt file, an architecture not served, more
    memory than a worker's budget): the operator's to fix, no retry of the client's helps."""

    status = 500
    type = "server_error"
    code = "model_load_failed"


class OnDemand:
    def __init__(self, r, keys: Keys, default_keep_alive: float, wait_s: float):
        self.r, self.keys = r, keys
        self.default_keep_alive = default_keep_alive
        self.wait_s = wait_s
        self._catalogue: tuple[float, dict[str, dict]] = (-CATALOGUE_CACHE_S, {})

    async def catalogue(self) -> dict[str, dict]:
        """Model -> {name, source, size}: what workers with a catalogue may load."""
        stamp, found = self._catalogue
        if time.monotonic() - stamp >= CATALOGUE_CACHE_S:
            found = decode(await self.r.hgetall(self.keys.catalogue))
            self._catalogue = (time.monotonic(), found)
        return found

    async def residents(self) -> dict[str, dict]:
        return fresh_residents(await self.r.hgetall(self.keys.resident))

    async def keep(self, model: str, keep_alive: float | None) -> None:
        """Set how long ``model`` stays loaded after its last request (this request's
        keep_alive, else the default), as Ollama does on every request."""
        keep_alive = requested_keep_alive.get() if keep_alive is None else keep_alive
        seconds = self.default_keep_alive if keep_alive is None else keep_alive
        await self.r.hset(self.keys.keep_alive, model, repr(float(seconds)))

    async def unload(self, model: str) -> None:
        """Have the workers holding ``model`` unload it once idle."""
        await self.r.hset(self.keys.unload, model, repr(time.time()))

    async def sleep(self, model: str) -> None:
        """Have the workers holding ``model`` put it to sleep once idle."""
        await self.r.hset(self.keys.sleep, model, repr(time.time()))

    async def awake(self, model: str) -> bool:
        """Whether a worker holds ``model`` (not asleep, not unloaded)."""
        return bool(holders(await self.residents(), model))

    async def wish(self, model: str, since: float, until: float) -> None:
        """Ask for ``model`` for a request waiting since ``since``, until ``until``."""
        record = {"since": since, "until": until}
        await self.r.hset(self.keys.wanted, model, json.dumps(record))

    async def failure(self, model: str, since: float) -> str | None:
        """The error of a load of ``model`` that failed after ``since``."""
        raw = await self.r.hget(self.keys.load_failed, model)
        found = decode({model: raw}).get(model) if raw is not None else None
        if found is None or float(found.get("at", 0)) < since:
            return None
        return str(found.get("error"))

    async def load(self, model: str, probe, kind) -> EngineStatus:
        """Wait for a worker to load ``model`` (asking for it); its engine once one serves it.
        A load that failed a moment ago, or fails while this waits, is a ModelLoadFailed; the
        wait ends at the request's deadline (``engine_client/deadline``) with its error."""
        started = time.time()
        error = await self.failure(model, started - FAILED_LOAD_HOLD_S)
        deadline = current_deadline(self.wait_s)
        wished = 0.0
        while error is None:
            if any(e.model == model for e in await probe.engines(max_age=0.0)):
                return await probe.require_engine(model, kind)
            if deadline.passed():
                raise deadline.exceeded(
                    f"no worker loaded {model!r} in that time (workers with LLMQ_CATALOGUE "
                    "and room for it are needed)"
                )
            if time.monotonic() - wished >= REWISH_S:
                await self.wish(model, started, deadline.at)
                wished = time.monotonic()
            await asyncio.sleep(min(POLL_S, max(0.0, deadline.at - time.time())))
            error = await self.failure(model, started)
        raise ModelLoadFailed(f"the model {model!r} could not be loaded: {error}")
