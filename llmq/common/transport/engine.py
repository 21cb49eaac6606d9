"""The engine's side of the Redis transport (synchronous redis-py: the engine loop runs in a
plain thread): pull requests from its model's stream, publish and record their tokens, finish,
fail or dead-letter them, heartbeat, and claim the requests of workers that died."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from llmq.common.engine_status import EngineStatus
from llmq.common.protocol import EngineError, EngineRequest, OutputMessage
from llmq.common.transport.keys import GROUP, HANDBACK_PREFIX, RECORD_SCRIPT, Keys, as_text

log = logging.getLogger(__name__)

_HANDBACK_IDLE_MS = 200


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

    # Redis unreachable or slow: the engine loop closes this, waits, and sets it up again.
    # What the engine loop survives by setting up again after a backoff: an outage, and every
    # error reply (a deleted stream's NOGROUP or UNBLOCKED, which setup's XGROUP CREATE MKSTREAM
    # mends; OOM under maxmemory; READONLY from a replica after a failover). A loop that ended
    # on one of these left the worker answering pings with no engine behind it.
    transient_errors: tuple[type[Exception], ...] = (
        redis.ConnectionError,
        redis.TimeoutError,
        redis.ResponseError,
    )

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
        return self._prepare(entries, self._own_deliveries(count) if own_pending else None)

    def _own_deliveries(self, count: int) -> dict[str, int]:
        """How often each entry this worker holds was delivered, this read included: a worker
        restarted under the same name takes back its own entries, and a request that crashed
        it each time must reach the dead letters, not run forever at a count of 1."""
        rows = self.r.xpending_range(self.stream, GROUP, "-", "+", count, consumername=self.worker)
        return {as_text(r["message_id"]): int(r["times_delivered"]) for r in rows}

    def _prepare(self, entries: list[tuple], deliveries: dict[str, int] | None = None):
        """Parse entries and fetch, in one round trip, each request's state and prior tokens."""
        pulled: list[PulledRequest] = []
        for eid, fields in entries:
            fields = {as_text(k): as_text(v) for k, v in fields.items()}
            try:
                request = EngineRequest.from_json(fields["payload"])
            except Exception:  # a malformed entry must not stop the engine
                log.warning("malformed stream entry %s: %r", as_text(eid), fields)
                request = None
            pulled.append(
                PulledRequest(
                    as_text(eid),
                    request,
                    [],
                    deliveries=(deliveries or {}).get(as_text(eid), 1),
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
                p.cancelled = state is not None and as_text(state) == "cancelled"
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
                data = as_text(msg["data"])
                if data.startswith(HANDBACK_PREFIX):
                    self.handed_back.add(data.removeprefix(HANDBACK_PREFIX))
                else:
                    ids.append(data)
        return ids

    def announce_handback(self) -> None:
        """Tell the other engines that this worker, shutting down, left requests pending: they
        claim them at once instead of at their next periodic look for dead workers."""
        self.r.publish(self.keys.cancel, HANDBACK_PREFIX + self.worker)

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
                pipe.eval(RECORD_SCRIPT, 1, self.keys.tokens(rid), msg.index, *msg.tokens)
                if msg.logprobs:  # so that a client that missed them gets them back too
                    entries = [json.dumps(lp, separators=(",", ":")) for lp in msg.logprobs]
                    pipe.eval(RECORD_SCRIPT, 1, self.keys.logprobs(rid), msg.index, *entries)
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
        pipe.zadd(self.keys.engines_index, {self.worker: time.time()})
        pipe.execute()

    def remove_heartbeat(self) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.keys.engine(self.worker))
        pipe.zrem(self.keys.engines_index, self.worker)
        pipe.execute()

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
            name = as_text(c["name"])
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
            deliveries = {as_text(r["message_id"]): int(r["times_delivered"]) + 1 for r in rows}
            ids = list(deliveries)
            # Handed back: no need to wait out the idle time that tells a dead worker from a
            # busy one (a short one still makes a second claimer lose the race).
            idle = _HANDBACK_IDLE_MS if name in self.handed_back else min_idle_ms
            got = self.r.xclaim(self.stream, GROUP, self.worker, idle, ids)
            # Entries deleted meanwhile come back as nil / empty.
            entries = [(eid, fields) for eid, fields in got if fields]
            missing = {as_text(eid) for eid, fields in got if not fields}
            for eid in missing:
                self.r.xack(self.stream, GROUP, eid)
            if entries:
                log.warning("claimed %d requests from dead worker %s", len(entries), name)
            claimed.extend(self._prepare(entries, deliveries))
        self.handed_back.clear()
        return claimed
