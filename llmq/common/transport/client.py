"""The API's side of the Redis transport (redis.asyncio): enqueue and cancel requests, route
their output messages (``replies``), and read requests', queues' and engines' state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import redis.asyncio as aioredis

from llmq.common.engine_status import EngineStatus
from llmq.common.lora_adapters import AdapterRecord
from llmq.common.protocol import EngineRequest
from llmq.common.transport.keys import CANCEL_SCRIPT, ENQUEUE_SCRIPT, GROUP, Keys, as_text
from llmq.common.transport.output_log import merge
from llmq.common.transport.replies import ReplyRouter
from llmq.common.transport.scripts import READ_SCRIPT

log = logging.getLogger(__name__)


class AsyncTransport:
    """The API's side (redis.asyncio): enqueue, cancel, read state, and this process's output
    channel (``ReplyRouter``) routing output messages to per-request queues."""

    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.r = client
        self.keys = keys
        self.replies = ReplyRouter(client, keys)
        self._enqueue = client.register_script(ENQUEUE_SCRIPT)
        self._cancel = client.register_script(CANCEL_SCRIPT)
        self._read = client.register_script(READ_SCRIPT)
        self._releasing: set[asyncio.Task] = set()

    async def close(self) -> None:
        await self.settle()
        await self.replies.close()

    async def ensure_group(self, model: str) -> None:
        try:
            await self.r.xgroup_create(self.keys.requests(model), GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def subscribe(
        self, request_id: str, model: str, timeout: float = 5.0
    ) -> tuple[asyncio.Queue, str]:
        """A queue for a request's output messages, routed from this process's channel for
        its model (on which Redis has confirmed the subscription before this returns), and
        the ``reply_to`` the request names: that channel and the request's key in its frames
        (``<channel>#<key>``, a few characters: frames name every request of a step)."""
        await self.replies.listen(model, timeout)
        queue, key = self.replies.route(request_id)
        return queue, f"{self.replies.channel(model)}#{key}"

    def release(self, request_id: str, model: str, cancel: bool) -> None:
        """Stop routing a request's output and (``cancel``) cancel it on its engine. Not
        awaited: the cancel runs in a task of its own, since the caller may sit in a cancelled
        scope (the client disconnected) where any await raises at once."""
        self.replies.unroute(request_id)
        if not cancel:
            return
        task = asyncio.get_running_loop().create_task(self._cancel_quietly(request_id, model))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _cancel_quietly(self, request_id: str, model: str) -> None:
        with contextlib.suppress(Exception):
            await self.cancel(request_id, model)

    async def settle(self) -> None:
        """Wait for the releases under way (tests, shutdown)."""
        while self._releasing:
            await asyncio.gather(*list(self._releasing), return_exceptions=True)

    async def enqueue(
        self,
        request: EngineRequest,
        max_queue: int,
        ttl: int,
        attach: bool = False,
        slots: int = 1,
        target: str = "",
    ) -> str | None:
        """Add the request to its model's stream; None when the queue has no room for
        ``slots`` more (0 ``max_queue``: no limit); "attached" when ``attach`` and a request
        with this id already exists. ``target``: the worker placement chose for it."""
        keys = self.keys.for_model(request.model)
        entry = await self._enqueue(
            keys=[keys.requests(request.model), keys.req(request.id)],
            args=[
                request.id,
                request.to_json(),
                max_queue,
                GROUP,
                request.created,
                request.model,
                ttl,
                request.kind,
                "1" if attach else "0",
                slots,
                request.reply_to,
                target,
            ],
        )
        return as_text(entry) if entry else None

    async def cancel(self, request_id: str, model: str) -> None:
        keys = self.keys.for_model(model)
        await self._cancel(keys=[keys.req(request_id)], args=[request_id, self.keys.cancel])

    async def request_state(
        self, request_id: str, model: str, logprobs: bool = False
    ) -> tuple[dict[str, str], list[int], list[dict]]:
        """The request's state, its recorded tokens and (``logprobs``) their logprobs: its
        list and what its owner's log holds past it, read in one atomic script."""
        k = self.keys.for_model(model)
        keys = [k.req(request_id), k.tokens(request_id)]
        args = [k.log_prefix, request_id, k.out(request_id)]
        raw, recorded, logged = await self._read(keys=keys, args=args)
        state = {as_text(raw[i]): as_text(raw[i + 1]) for i in range(0, len(raw) - 1, 2)}
        values = [as_text(v) for v in recorded + logged]
        ids, merged_lps = merge(values, logprobs)
        return state, ids, merged_lps or []

    async def queue_stats(self, model: str) -> tuple[int, int]:
        """(lag, pending) of a model's stream: requests no engine has taken yet, and requests
        engines are serving. Finished entries are deleted, so lag is XLEN minus pending."""
        stream = self.keys.requests(model)
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(stream)
        pipe.xpending(stream, GROUP)
        try:
            length, pending = await pipe.execute()
        except aioredis.ResponseError:
            return 0, 0
        pending = int(pending["pending"])
        return max(0, int(length) - pending), pending

    async def cached_prefixes(
        self, model: str, workers: list[str], hashes: list[int]
    ) -> dict[str, int]:
        """For each worker, how many of the leading block ``hashes`` its prefix cache holds
        (its published set: ``Keys.cached``), in one round trip."""
        if not hashes or not workers:
            return dict.fromkeys(workers, 0)
        keys = self.keys.for_model(model)
        pipe = self.r.pipeline(transaction=False)
        for worker in workers:
            pipe.smismember(keys.cached(worker), hashes)
        held = {}
        for worker, flags in zip(workers, await pipe.execute(), strict=True):
            held[worker] = next((i for i, f in enumerate(flags) if not f), len(flags))
        return held

    async def known_models(self) -> dict[str, dict]:
        """Every model a worker has ever served, with where its weights come from."""
        raw = await self.r.hgetall(self.keys.models)
        return {as_text(k): json.loads(v) for k, v in raw.items()}

    async def adapters(self) -> dict[str, AdapterRecord]:
        """Every LoRA adapter offered, by name."""
        raw = await self.r.hgetall(self.keys.loras)
        return {as_text(k): AdapterRecord.from_json(v) for k, v in raw.items()}

    async def add_adapter(self, record: AdapterRecord) -> bool:
        """Offer an adapter; False when one of that name is offered already."""
        return bool(await self.r.hsetnx(self.keys.loras, record.name, record.to_json()))

    async def remove_adapter(self, name: str) -> bool:
        return bool(await self.r.hdel(self.keys.loras, name))

    async def engines(self) -> list[EngineStatus]:
        """The live engines' heartbeats, from the registry of workers (a SCAN of the keyspace
        once a second per API process grew with every key Redis holds). A worker whose
        heartbeat expired leaves the registry here."""
        workers = [as_text(w) for w in await self.r.zrange(self.keys.engines_index, 0, -1)]
        if not workers:
            return []
        pipe = self.r.pipeline(transaction=False)
        for worker in workers:
            pipe.hgetall(self.keys.engine(worker))
        rows = await pipe.execute()
        gone = [w for w, row in zip(workers, rows, strict=True) if not row]
        if gone:
            await self.r.zrem(self.keys.engines_index, *gone)
        return [
            EngineStatus.from_redis(row, worker)
            for worker, row in zip(workers, rows, strict=True)
            if row
        ]
