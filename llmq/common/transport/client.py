"""The API's side of the Redis transport (redis.asyncio): enqueue and cancel requests, route
their output messages, and read requests', queues' and engines' state.

Each process listens on one channel of its own (``{p}:replies:{replica}``), named in every
request it enqueues: a worker sends it one message a step with the news of all its requests
(a SUBSCRIBE and an UNSUBSCRIBE per request, and a PUBLISH per request and step, were most of
Redis's work per token). A message is a frame of ``output_log.encode_frame``.."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid

import redis
import redis.asyncio as aioredis

from llmq.common.engine_status import EngineStatus
from llmq.common.protocol import EngineRequest
from llmq.common.transport.keys import CANCEL_SCRIPT, ENQUEUE_SCRIPT, GROUP, Keys, as_text
from llmq.common.transport.output_log import decode_frame, merge
from llmq.common.transport.scripts import READ_SCRIPT

log = logging.getLogger(__name__)


class AsyncTransport:
    """The API's side (redis.asyncio): enqueue, cancel, and one pub/sub connection on this
    process's channel that routes output messages to per-request queues."""

    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.r = client
        self.keys = keys
        self.replica = uuid.uuid4().hex[:12]
        self.reply_channel = keys.replies(self.replica)
        self._enqueue = client.register_script(ENQUEUE_SCRIPT)
        self._cancel = client.register_script(CANCEL_SCRIPT)
        self._read = client.register_script(READ_SCRIPT)
        self._pubsub: aioredis.client.PubSub | None = None
        self._listener: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._ready = asyncio.Event()  # Redis confirmed the subscription to the channel
        self._lock = asyncio.Lock()
        self._closing = False
        self._releasing: set[asyncio.Task] = set()

    async def start(self, timeout: float = 5.0) -> None:
        """Listen on this process's channel (confirmed by Redis: pub/sub keeps nothing, so
        this happens before any request is enqueued)."""
        async with self._lock:
            if self._listener is None:
                self._closing = False
                self._ready.clear()
                self._pubsub = self.r.pubsub()
                await self._subscribe_channel()
                self._listener = asyncio.create_task(self._listen(), name="llmq-output-router")
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def _subscribe_channel(self) -> None:
        for attempt in range(5):
            try:
                await self._pubsub.subscribe(self.reply_channel)
                return
            except (redis.ConnectionError, redis.TimeoutError, RuntimeError):
                # Redis restarting: the listener's reconnect resubscribes; try again shortly.
                if attempt == 4:
                    raise
                await asyncio.sleep(0.1 * 2**attempt)

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
        """A queue for a request's output messages, routed from this process's channel (on
        which Redis has confirmed the subscription before this returns)."""
        await self.start(timeout)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def release(self, request_id: str, cancel: bool) -> None:
        """Stop routing a request's output and (``cancel``) cancel it on its engine. Not
        awaited: the cancel runs in a task of its own, since the caller may sit in a cancelled
        scope (the client disconnected) where any await raises at once."""
        self._queues.pop(request_id, None)
        if not cancel:
            return
        task = asyncio.get_running_loop().create_task(self._cancel_quietly(request_id))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _cancel_quietly(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.cancel(request_id)

    async def settle(self) -> None:
        """Wait for the releases under way (tests, shutdown)."""
        while self._releasing:
            await asyncio.gather(*list(self._releasing), return_exceptions=True)

    async def _listen(self) -> None:
        backoff = 0.1
        while not self._closing:
            try:
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
            kind = msg.get("type")
            if kind == "subscribe":
                self._ready.set()
            elif kind == "message":
                self._route(msg["data"])

    def _route(self, data: bytes) -> None:
        try:
            messages = decode_frame(data)
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("unreadable output message dropped: %r (%s)", data[:200], exc)
            return
        for request_id, message in messages.items():
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(message)

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
        """The request's state, its recorded tokens and (``logprobs``) their logprobs: its
        list and what its owner's log holds past it, read in one atomic script."""
        k = self.keys
        keys = [k.req(request_id), k.tokens(request_id), k.logprobs(request_id)]
        args = [k.log_prefix, request_id, "1" if logprobs else "0"]
        raw, tokens, lps, values = await self._read(keys=keys, args=args)
        state = {as_text(raw[i]): as_text(raw[i + 1]) for i in range(0, len(raw) - 1, 2)}
        listed = [json.loads(x) for x in lps] if logprobs else None
        ids, merged_lps = merge([int(t) for t in tokens], listed, [as_text(v) for v in values])
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
