"""An API process's (or batch task process's) output channel: one pub/sub connection, one
channel of its own (one per model in a Redis Cluster, each a sharded channel in its model's
slot), and the routing of each frame's messages to per-request queues.

A worker sends a process one message a step with the news of all its requests (a SUBSCRIBE
and an UNSUBSCRIBE per request, and a PUBLISH per request and step, were most of Redis's work
per token); a message is a frame of ``output_log.encode_frame``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid

import redis
import redis.asyncio as aioredis

from llmq.common.transport.keys import Keys, as_text
from llmq.common.transport.output_log import decode_frame

log = logging.getLogger(__name__)


class ReplyRouter:
    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.r = client
        self.keys = keys
        self.replica = uuid.uuid4().hex[:12]
        self.sharded = keys.cluster
        self._pubsub = None
        self._listener: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}  # a request's key in frames -> its queue
        self._keys: dict[str, str] = {}  # request id -> its key
        self._counter = itertools.count(1)
        self._confirmed: dict[str, asyncio.Event] = {}  # channel -> Redis confirmed it
        self._lock = asyncio.Lock()
        self._closing = False

    def channel(self, model: str) -> str:
        """The channel this process's requests for ``model`` name as their ``reply_to``."""
        return self.keys.for_model(model).replies(self.replica)

    async def listen(self, model: str, timeout: float = 5.0) -> None:
        """Subscribe to the model's channel and wait until Redis confirms it: pub/sub keeps
        nothing, so this happens before a request naming it is enqueued."""
        channel = self.channel(model)
        async with self._lock:
            if self._pubsub is None:
                self._closing = False
                self._pubsub = self.r.pubsub()
            if channel not in self._confirmed:
                self._confirmed[channel] = asyncio.Event()
                await self._subscribe(channel)
            if self._listener is None:  # after the first subscribe: there is a connection to read
                self._listener = asyncio.create_task(self._listen(), name="llmq-output-router")
        await asyncio.wait_for(self._confirmed[channel].wait(), timeout)

    async def _subscribe(self, channel: str) -> None:
        for attempt in range(5):
            try:
                if self.sharded:
                    await self._pubsub.ssubscribe(channel)
                else:
                    await self._pubsub.subscribe(channel)
                return
            except (redis.ConnectionError, redis.TimeoutError, RuntimeError):
                # Redis restarting: the listener's reconnect resubscribes; try again shortly.
                if attempt == 4:
                    self._confirmed.pop(channel, None)
                    raise
                await asyncio.sleep(0.1 * 2**attempt)

    def route(self, request_id: str) -> tuple[asyncio.Queue, str]:
        """A queue for the request's messages and its key in this process's frames: a short
        counter, not the request's id (32 characters, most of a frame's bytes)."""
        key = _base36(next(self._counter))
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[key] = queue
        self._keys[request_id] = key
        return queue, key

    def unroute(self, request_id: str) -> None:
        self._queues.pop(self._keys.pop(request_id, ""), None)

    async def close(self) -> None:
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
        self._confirmed.clear()

    async def _next(self):
        if self.sharded:
            return await self._pubsub.get_sharded_message(timeout=1.0)
        return await self._pubsub.get_message(timeout=1.0)

    async def _listen(self) -> None:
        backoff = 0.1
        while not self._closing:
            try:
                msg = await self._next()
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
            if kind in ("subscribe", "ssubscribe"):
                event = self._confirmed.get(as_text(msg.get("channel")))
                if event is not None:
                    event.set()
            elif kind in ("message", "smessage"):
                self._dispatch(msg["data"])

    def _dispatch(self, data: bytes) -> None:
        try:
            messages = decode_frame(data)
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("unreadable output message dropped: %r (%s)", data[:200], exc)
            return
        for key, message in messages.items():
            queue = self._queues.get(key)
            if queue is not None:
                queue.put_nowait(message)


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out
