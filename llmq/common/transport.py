"""The Redis transport: the only module that knows key names, stream fields and message formats.

Everything stored is JSON or plain text, so redis-cli shows a person what is happening:

- ``{p}:requests:{model}``    stream per model, consumer group ``engines``: one entry per request
                              (fields ``id``, ``kind``, ``payload`` = EngineRequest JSON)
- ``{p}:out:{id}``            pub/sub channel: OutputMessage JSON for one request
- ``{p}:cancel``              pub/sub channel: ids of requests to abort
- ``{p}:req:{id}``            hash (TTL): state, worker, entry, finish_reason, timings
- ``{p}:req:{id}:tokens``     list (TTL): every token generated so far (for recovery and gaps)
- ``{p}:engines:{worker}``    hash (TTL = heartbeat): model, KV blocks, running, waiting, ...
- ``{p}:dead``                stream: requests delivered too often, with the reason
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from llmq.common.engine_status import EngineStatus
from llmq.common.protocol import EngineError, EngineRequest, OutputMessage

log = logging.getLogger(__name__)

GROUP = "engines"
_HANDBACK = "handback:"  # on the cancel channel, never a request id
_HANDBACK_IDLE_MS = 200


class Keys:
    def __init__(self, prefix: str = "llmq"):
        self.prefix = prefix

    def requests(self, model: str) -> str:
        """One stream per served model: a worker joins the stream of the model it serves."""
        return f"{self.prefix}:requests:{model}"

    @property
    def requests_pattern(self) -> str:
        return f"{self.prefix}:requests:*"

    def out(self, request_id: str) -> str:
        return f"{self.prefix}:out:{request_id}"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}:cancel"

    def req(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def tokens(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:tokens"

    def logprobs(self, request_id: str) -> str:
        """Beside the tokens, for requests that asked for logprobs: one JSON entry a token."""
        return f"{self.prefix}:req:{request_id}:logprobs"

    def engine(self, worker: str) -> str:
        return f"{self.prefix}:engines:{worker}"

    @property
    def engines_pattern(self) -> str:
        return f"{self.prefix}:engines:*"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    # OpenAI Batch API objects (common/store.py)
    def file(self, file_id: str) -> str:
        return f"{self.prefix}:files:{file_id}"

    def file_content(self, file_id: str) -> str:
        return f"{self.prefix}:files:{file_id}:content"

    @property
    def files_index(self) -> str:
        return f"{self.prefix}:files"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batches:{batch_id}"

    def batch_results(self, batch_id: str) -> str:
        """Hash: line number -> output line (checkpoint: a line is run at most once)."""
        return f"{self.prefix}:batches:{batch_id}:results"

    def batch_lease(self, batch_id: str) -> str:
        return f"{self.prefix}:batches:{batch_id}:lease"

    def batch_dispatch(self, batch_id: str) -> str:
        """Short-lived marker: a worker has just re-dispatched this batch's task."""
        return f"{self.prefix}:batches:{batch_id}:dispatch"

    @property
    def batches_index(self) -> str:
        return f"{self.prefix}:batches"

    @property
    def batches_active(self) -> str:
        """Set of batches not yet in a final state (for re-dispatch when a lease expires)."""
        return f"{self.prefix}:batches:active"

    @property
    def models(self) -> str:
        """Hash: every model a worker has served -> JSON {source, kind, max_model_len}."""
        return f"{self.prefix}:models"


# Enqueue only while fewer than ARGV[3] entries wait undelivered (XLEN minus the pending ones:
# finished entries are deleted), atomically, so the limit holds across API replicas. With
# ARGV[9] = '1' a request whose id is already live or finished is attached to, not re-sent
# (a batch task re-run after its worker died follows the lines its first run started).
_ENQUEUE = """
local stream, req = KEYS[1], KEYS[2]
if ARGV[9] == '1' then
  local state = redis.call('HGET', req, 'state')
  if state == 'queued' or state == 'running' or state == 'finished' then return 'attached' end
end
local limit = tonumber(ARGV[3])
if limit > 0 then
  local waiting = redis.call('XLEN', stream)
  local ok, pending = pcall(redis.call, 'XPENDING', stream, ARGV[4])
  if ok then waiting = waiting - pending[1] end
  if waiting >= limit then return false end
end
redis.call('HSET', req, 'state', 'queued', 'created', ARGV[5], 'model', ARGV[6])
redis.call('EXPIRE', req, ARGV[7])
return redis.call('XADD', stream, '*', 'id', ARGV[1], 'kind', ARGV[8], 'payload', ARGV[2])
"""

# Mark a live request cancelled (a worker that pulls it later drops it) and tell the engines.
_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'queued' or state == 'running' then redis.call('HSET', KEYS[1], 'state', 'cancelled') end
return redis.call('PUBLISH', KEYS[2], ARGV[1])
"""


# Append a message's tokens to the request's record idempotently: a retried write (the
# connection dropped before EXEC answered) must not record a token twice.
_RECORD = """
local have = redis.call('LLEN', KEYS[1])
local first = tonumber(ARGV[1])
for i = have - first + 2, #ARGV do redis.call('RPUSH', KEYS[1], ARGV[i]) end
return have
"""


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def ensure_group(client: redis.Redis, stream: str) -> None:
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


@dataclass(slots=True)
class PulledRequest:
    entry_id: str
    request: EngineRequest | None  # None: the entry could not be parsed
    prior_tokens: list[int]  # tokens generated before (a resumed request)
    cancelled: bool = False
    deliveries: int = 1
    raw: dict | None = None


@dataclass(slots=True)
class Emission:
    """One request's news from one engine step, for ``EngineTransport.emit``."""

    request_id: str
    entry_id: str
    message: OutputMessage


class EngineTransport:
    """The worker's side (synchronous redis-py; the engine loop runs in a plain thread)."""

    def __init__(self, client: redis.Redis, keys: Keys, worker: str, model: str, request_ttl: int):
        self.r = client
        self.keys = keys
        self.worker = worker
        self.model = model
        self.stream = keys.requests(model)
        self.request_ttl = request_ttl
        self._pubsub = None
        self.handed_back: set[str] = set()  # workers that announced a hand-back

    def setup(self, status: EngineStatus | None = None) -> None:
        ensure_group(self.r, self.stream)
        if status is not None:
            model_info = {
                "source": status.source,
                "kind": status.kind,
                "max_model_len": status.max_model_len,
            }
            self.r.hset(self.keys.models, self.model, json.dumps(model_info))
        self._pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(self.keys.cancel)

    def close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                self._pubsub.close()
            self._pubsub = None

    # ---- requests in -----------------------------------------------------------------
    def pull(
        self, count: int, block_ms: int | None, own_pending: bool = False
    ) -> list[PulledRequest]:
        """New entries for this worker (or, with ``own_pending``, the ones it already holds)."""
        if count <= 0:
            return []
        resp = self.r.xreadgroup(
            GROUP,
            self.worker,
            {self.stream: "0" if own_pending else ">"},
            count=count,
            block=None if own_pending else block_ms,
        )
        entries = [(eid, fields) for _, items in resp or [] for eid, fields in items if fields]
        return self._prepare(entries)

    def _prepare(self, entries: list[tuple], deliveries: dict[str, int] | None = None):
        """Parse entries and fetch, in one round trip, each request's state and prior tokens."""
        pulled: list[PulledRequest] = []
        for eid, fields in entries:
            fields = {_str(k): _str(v) for k, v in fields.items()}
            try:
                request = EngineRequest.from_json(fields["payload"])
            except Exception:  # a malformed entry must not stop the engine
                log.warning("malformed stream entry %s: %r", _str(eid), fields)
                request = None
            pulled.append(
                PulledRequest(
                    _str(eid),
                    request,
                    [],
                    deliveries=(deliveries or {}).get(_str(eid), 1),
                    raw=fields,
                )
            )
        live = [p for p in pulled if p.request is not None]
        if live:
            pipe = self.r.pipeline(transaction=False)
            for p in live:
                pipe.hget(self.keys.req(p.request.id), "state")
                pipe.lrange(self.keys.tokens(p.request.id), 0, -1)
            replies = pipe.execute()
            for i, p in enumerate(live):
                state, tokens = replies[2 * i], replies[2 * i + 1]
                p.cancelled = state is not None and _str(state) == "cancelled"
                p.prior_tokens = [int(t) for t in tokens]
        return pulled

    def mark_running(self, pulled: Iterable[PulledRequest]) -> None:
        pipe = self.r.pipeline(transaction=False)
        now = time.time()
        for p in pulled:
            pipe.hset(
                self.keys.req(p.request.id),
                mapping={"state": "running", "worker": self.worker, "started": now},
            )
        pipe.execute()

    def drain_cancels(self) -> list[str]:
        """Request ids cancelled since the last call. Hand-back notices from workers shutting
        down (the same channel) go to ``handed_back``."""
        ids = []
        while self._pubsub is not None:
            msg = self._pubsub.get_message(timeout=0)
            if msg is None:
                break
            if msg.get("type") == "message":
                data = _str(msg["data"])
                if data.startswith(_HANDBACK):
                    self.handed_back.add(data.removeprefix(_HANDBACK))
                else:
                    ids.append(data)
        return ids

    def announce_handback(self) -> None:
        """Tell the other engines that this worker, shutting down, left requests pending: they
        claim them at once instead of at their next periodic look for dead workers."""
        self.r.publish(self.keys.cancel, _HANDBACK + self.worker)

    # ---- outputs back ----------------------------------------------------------------
    def emit(self, emissions: list[Emission]) -> None:
        """Record and publish one step's tokens for every request in one round trip. MULTI
        makes record and publish one unit: what a client saw is what recovery resumes from."""
        if not emissions:
            return
        pipe = self.r.pipeline(transaction=True)
        now = time.time()
        for e in emissions:
            msg = e.message
            rid = e.request_id
            if msg.tokens:
                # EVAL, not a registered script: in a pipeline redis-py checks SCRIPT EXISTS
                # first, a second round trip every step. Redis caches the compiled body.
                pipe.eval(_RECORD, 1, self.keys.tokens(rid), msg.index, *msg.tokens)
                if msg.logprobs:  # so that a client that missed them gets them back too
                    entries = [json.dumps(lp, separators=(",", ":")) for lp in msg.logprobs]
                    pipe.eval(_RECORD, 1, self.keys.logprobs(rid), msg.index, *entries)
            pipe.publish(self.keys.out(rid), msg.to_json())
            if msg.done:
                self._finish(pipe, rid, e.entry_id, msg, now)
        pipe.execute()

    def _finish(self, pipe, request_id: str, entry_id: str, msg: OutputMessage, now: float) -> None:
        state = "failed" if msg.error else "finished"
        mapping = {"state": state, "finished": now, "finish_reason": msg.finish_reason or ""}
        if msg.error:
            mapping["error"] = msg.error.message
        pipe.hset(self.keys.req(request_id), mapping=mapping)
        pipe.expire(self.keys.req(request_id), self.request_ttl)
        pipe.expire(self.keys.tokens(request_id), self.request_ttl)
        pipe.expire(self.keys.logprobs(request_id), self.request_ttl)
        pipe.xack(self.stream, GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)

    def fail(self, request_id: str | None, entry_id: str, index: int, error: EngineError) -> None:
        """End a request with an error its client sees (or just drop an unparsable entry)."""
        if request_id is None:
            pipe = self.r.pipeline(transaction=True)
            pipe.xack(self.stream, GROUP, entry_id)
            pipe.xdel(self.stream, entry_id)
            pipe.execute()
            return
        self.emit(
            [
                Emission(
                    request_id,
                    entry_id,
                    OutputMessage(index=index, error=error, worker=self.worker),
                )
            ]
        )

    def dead_letter(self, p: PulledRequest, reason: str) -> None:
        fields = dict(p.raw or {})
        fields.update(reason=reason, deliveries=str(p.deliveries), entry=p.entry_id)
        self.r.xadd(self.keys.dead, fields, maxlen=10000, approximate=True)
        rid = p.request.id if p.request else None
        self.fail(
            rid, p.entry_id, len(p.prior_tokens), EngineError(reason, "server_error", "dead_letter")
        )

    # ---- liveness and recovery -------------------------------------------------------
    def heartbeat(self, status: EngineStatus, ttl: float) -> None:
        key = self.keys.engine(self.worker)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping=status.to_redis())
        pipe.pexpire(key, int(ttl * 1000))
        pipe.execute()

    def remove_heartbeat(self) -> None:
        self.r.delete(self.keys.engine(self.worker))

    def claim_orphans(self, min_idle_ms: int, max_count: int) -> list[PulledRequest]:
        """Take over the pending entries of consumers whose heartbeat has expired. Only dead
        consumers: pending idle time counts from delivery, so a busy live engine's entries look
        idle too. ``min_idle_ms`` makes a second claimer lose the race to the first."""
        try:
            consumers = self.r.xinfo_consumers(self.stream, GROUP)
        except redis.ResponseError:
            return []
        claimed: list[PulledRequest] = []
        for c in consumers:
            name = _str(c["name"])
            if name == self.worker:
                continue
            if self.r.exists(self.keys.engine(name)):
                continue
            if int(c.get("pending", 0)) == 0:
                if c.get("idle", 0) > min_idle_ms:
                    self.r.xgroup_delconsumer(self.stream, GROUP, name)
                continue
            if len(claimed) >= max_count:
                break
            rows = self.r.xpending_range(
                self.stream, GROUP, "-", "+", max_count - len(claimed), consumername=name
            )
            if not rows:
                continue
            deliveries = {_str(r["message_id"]): int(r["times_delivered"]) + 1 for r in rows}
            ids = list(deliveries)
            # Handed back: no need to wait out the idle time that tells a dead worker from a
            # busy one (a short one still makes a second claimer lose the race).
            idle = _HANDBACK_IDLE_MS if name in self.handed_back else min_idle_ms
            got = self.r.xclaim(self.stream, GROUP, self.worker, idle, ids)
            # Entries deleted meanwhile come back as nil / empty.
            entries = [(eid, fields) for eid, fields in got if fields]
            missing = {_str(eid) for eid, fields in got if not fields}
            for eid in missing:
                self.r.xack(self.stream, GROUP, eid)
            if entries:
                log.warning("claimed %d requests from dead worker %s", len(entries), name)
            claimed.extend(self._prepare(entries, deliveries))
        self.handed_back.clear()
        return claimed


class AsyncTransport:
    """The API's side (redis.asyncio): enqueue, cancel, and one shared pub/sub connection that
    routes output messages to per-request queues."""

    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.r = client
        self.keys = keys
        self._enqueue = client.register_script(_ENQUEUE)
        self._cancel = client.register_script(_CANCEL)
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
            channel = _str(msg.get("channel"))
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
        self, request: EngineRequest, max_queue: int, ttl: int, attach: bool = False
    ) -> str | None:
        """Add the request to its model's stream; None when the queue is full; "attached"
        when ``attach`` and a request with this id already exists."""
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
            ],
        )
        return _str(entry) if entry else None

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
            {_str(k): _str(v) for k, v in state.items()},
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
        return {_str(k): json.loads(v) for k, v in raw.items()}

    async def engines(self) -> list[EngineStatus]:
        """The live engines' heartbeats."""
        keys = [k async for k in self.r.scan_iter(match=self.keys.engines_pattern, count=100)]
        if not keys:
            return []
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        rows = await pipe.execute()
        prefix = len(self.keys.engine(""))
        return [
            EngineStatus.from_redis(row, _str(key)[prefix:])
            for key, row in zip(keys, rows, strict=True)
            if row
        ]
