"""The API's side of the Redis transport (redis.asyncio): enqueue and cancel requests, route
their output messages, and read requests', queues' and engines' state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import redis
import redis.asyncio as aioredis

from llmq.common.engine_status import EngineStatus
from llmq.common.protocol import EngineRequest, OutputMessage
from llmq.common.transport.keys import CANCEL_SCRIPT, ENQUEUE_SCRIPT, GROUP, Keys, as_text

log = logging.getLogger(__name__)


class AsyncTransport:
    """The API's side (redis.asyncio): enqueue, cancel, and one shared pub/sub connection that
    routes output messages to per-request queues."""

    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.r = client
        self.keys = keys
        self._enqueue = client.register_script(ENQUEUE_SCRIPT)
        self._cancel = client.register_script(CANCEL_SCRIPT)
        self._pubsub: aioredis.client.PubSub | None = None
        self._listener: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._subscribed: dict[str, asyncio.Event] = {}
        self._lock = asyncio.Lock()
        self._closing = False
        self._wake = asyncio.Event()
        self._releasing: set[asyncio.Task] = set()

    async def start(self) -> None:
        if self._listener is None:
            self._closing = False
            self._pubsub = self.r.pubsub()
            self._listener = asyncio.create_task(self._listen(), name="llmq-output-router")

    async def close(self) -> None:
        await self.settle()
        if self._listener is not None:
            # The flag as well as the cancel: redis-py's read timeout can swallow a
            # cancellation (Python 3.11), and the loop then ends on its next turn instead.
            self._closing = True
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._listener, 5)
            self._listener = None
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
            self._pubsub = None

    async def ensure_group(self, model: str) -> None:
        try:
            await self.r.xgroup_create(self.keys.requests(model), GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def subscribe(self, request_id: str, timeout: float = 5.0) -> asyncio.Queue:
        """Subscribe to a request's output channel and wait until Redis confirms it: pub/sub
        keeps nothing, so this must happen before the request is enqueued."""
        await self.start()
        channel = self.keys.out(request_id)
        queue: asyncio.Queue = asyncio.Queue()
        event = asyncio.Event()
        self._queues[channel] = queue
        self._subscribed[channel] = event
        try:
            for attempt in range(5):
                try:
                    async with self._lock:
                        await self._pubsub.subscribe(channel)
                    break
                except (redis.ConnectionError, redis.TimeoutError, RuntimeError):
                    # Redis restarted: the listener reconnects the pub/sub connection (and
                    # resubscribes) while this write races it; try again shortly.
                    if attempt == 4:
                        raise
                    await asyncio.sleep(0.1 * 2**attempt)
            self._wake.set()
            await asyncio.wait_for(event.wait(), timeout)
        except BaseException:
            self.release(request_id, cancel=False)
            raise
        return queue

    def release(self, request_id: str, cancel: bool) -> None:
        """Stop routing a request's output, unsubscribe, and (``cancel``) cancel it on its
        engine. Not awaited: the Redis calls run in a task of their own, since the caller may
        sit in a cancelled scope (the client disconnected) where any await raises at once and
        a subscription left behind would stay for the life of the process."""
        channel = self.keys.out(request_id)
        self._queues.pop(channel, None)
        self._subscribed.pop(channel, None)
        task = asyncio.get_running_loop().create_task(self._release(request_id, channel, cancel))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release(self, request_id: str, channel: str, cancel: bool) -> None:
        if cancel:
            with contextlib.suppress(Exception):
                await self.cancel(request_id)
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                async with self._lock:
                    if channel not in self._queues:  # not subscribed again meanwhile
                        await self._pubsub.unsubscribe(channel)

    async def settle(self) -> None:
        """Wait for the releases under way (tests, shutdown)."""
        while self._releasing:
            await asyncio.gather(*list(self._releasing), return_exceptions=True)

    async def _listen(self) -> None:
        backoff = 0.1
        while not self._closing:
            try:
                if not self._pubsub.subscribed:
                    # Nothing to read until the next subscribe, which wakes this at once (a
                    # polling sleep here added its period to the first token of lone requests).
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), 1.0)
                    continue
                msg = await self._pubsub.get_message(timeout=1.0)
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone: redis-py reconnects and resubscribes
                log.warning("output listener: %s; retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if msg is None:
                continue
            channel = as_text(msg.get("channel"))
            kind = msg.get("type")
            if kind == "subscribe":
                event = self._subscribed.get(channel)
                if event is not None:
                    event.set()
            elif kind == "message":
                queue = self._queues.get(channel)
                if queue is not None:
                    queue.put_nowait(OutputMessage.from_json(msg["data"]))

    async def enqueue(
        self,
        request: EngineRequest,
        max_queue: int,
        ttl: int,
        attach: bool = False,
        slots: int = 1,
    ) -> str | None:
        """Add the request to its model's stream; None when the queue has no room for
        ``slots`` more (0 ``max_queue``: no limit); "attached" when ``attach`` and a request
        with this id already exists."""
        entry = await self._enqueue(
            keys=[self.keys.requests(request.model), self.keys.req(request.id)],
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
            ],
        )
        return as_text(entry) if entry else None

    async def cancel(self, request_id: str) -> None:
        await self._cancel(keys=[self.keys.req(request_id), self.keys.cancel], args=[request_id])

    async def request_state(
        self, request_id: str, logprobs: bool = False
    ) -> tuple[dict[str, str], list[int], list[dict]]:
        """The request's state, its recorded tokens and (``logprobs``) their logprobs."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.req(request_id))
        pipe.lrange(self.keys.tokens(request_id), 0, -1)
        if logprobs:
            pipe.lrange(self.keys.logprobs(request_id), 0, -1)
        state, tokens, *lps = await pipe.execute()
        return (
            {as_text(k): as_text(v) for k, v in state.items()},
            [int(t) for t in tokens],
            [json.loads(x) for x in lps[0]] if lps else [],
        )

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

    async def known_models(self) -> dict[str, dict]:
        """Every model a worker has ever served, with where its weights come from."""
        raw = await self.r.hgetall(self.keys.models)
        return {as_text(k): json.loads(v) for k, v in raw.items()}

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
