"""The engine's side of the Redis transport (synchronous redis-py: the engine loop runs in a
plain thread): pull requests from its model's stream, publish and record their tokens, finish,
fail or dead-letter them, heartbeat, and claim the requests of workers that died."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterable

import redis

from llmq.common.engine_status import EngineStatus
from llmq.common.lora_adapters import AdapterRecord
from llmq.common.protocol import EngineError, EngineRequest, OutputMessage
from llmq.common.transport.engine_placement import PlacementSide
from llmq.common.transport.entries import (
    PulledRequest,
    ensure_group,
    entry_request_id,
    set_prior_tokens,
)
from llmq.common.transport.keys import GROUP, HANDBACK_PREFIX, HANDOVER_PREFIX, Keys, as_text
from llmq.common.transport.script_pipeline import script_pipeline
from llmq.common.transport.scripts import (
    CLAIM_SCRIPT,
    PULLED_SCRIPT,
    RUNNING_SCRIPT,
    TAKE_SCRIPT,
)
from llmq.common.transport.step_writer import Emission, Refusal, StepWriter

log = logging.getLogger(__name__)

_HANDBACK_IDLE_MS = 200


class EngineTransport(PlacementSide):
    """The worker's side (synchronous redis-py; the engine loop runs in a plain thread);
    ``placement``: it hands entries placed on other workers over to them
    (``engine_placement``)."""

    # Redis unreachable or slow: the engine loop closes this, waits, and sets it up again.
    # What the engine loop survives by setting up again after a backoff: an outage, and every
    # error reply (a deleted stream's NOGROUP or UNBLOCKED, which setup's XGROUP CREATE MKSTREAM
    # mends; OOM under maxmemory; READONLY from a replica after a failover). A loop that ended
    # on one of these left the worker answering pings with no engine behind it.
    transient_errors: tuple[type[Exception], ...] = (
        redis.ConnectionError,
        redis.TimeoutError,
        redis.ResponseError,
        redis.exceptions.RedisClusterException,  # no node of a cluster reachable, for now
    )

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        worker: str,
        model: str,
        request_ttl: int,
        placement: bool = False,
        adapters: tuple[AdapterRecord, ...] = (),
    ):
        """``adapters``: the LoRA adapters configured on this worker (LLMQ_LORA_MODULES),
        offered in the registry at each setup."""
        self.adapters = adapters
        self.r = client
        self.keys = keys.for_model(model)
        self.worker = worker
        self.model = model
        self.stream = keys.requests(model)
        self.request_ttl = request_ttl
        self._pubsub = None
        self.handed_back: set[str] = set()  # workers that announced a hand-back
        # Other live engines reading this model's stream, as the last claim_orphans counted
        # them (None: not counted yet).
        self.live_peers: int | None = None
        self._loaded: set[str] = set()  # scripts this Redis has cached (EVALSHA'd, not EVAL'd)
        self._shas: dict[str, str] = {}
        self.writer = StepWriter(client, self.keys, worker, self.stream, request_ttl, self._sha)
        self._init_placement(placement)

    def setup(self, status: EngineStatus | None = None) -> None:
        ensure_group(self.r, self.stream)
        self._loaded.clear()  # a Redis restarted since (its NOSCRIPT brought us here) has none
        self.writer.reset()
        self._published = None  # a Redis restarted since lost the published cached set
        if status is not None:
            model_info = {
                "source": status.source,
                "kind": status.kind,
                "max_model_len": status.max_model_len,
            }
            self.r.hset(self.keys.models, self.model, json.dumps(model_info))
        for record in self.adapters:
            self.r.hset(self.keys.loras, record.name, record.to_json())
        self._pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(self.keys.cancel)

    def close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                self._pubsub.close()
            self._pubsub = None

    def _sha(self, script: str) -> str:
        """The script's SHA, loaded into Redis once. Scripts go by EVALSHA: an EVAL sends the
        whole body with every request of every step, and redis-py's registered scripts check
        SCRIPT EXISTS first in a pipeline, a second round trip."""
        sha = self._shas.get(script)  # a str caches its hash: no SHA-1 of the body a step
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()
        if sha not in self._loaded:
            self.r.script_load(script)
            self._loaded.add(sha)
        return sha

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
        if not own_pending:
            entries = self._hand_over(entries)
        pulled = self._prepare(entries, self._own_deliveries(count) if own_pending else None)
        self._note_taken(pulled)
        return pulled

    def _own_deliveries(self, count: int) -> dict[str, int]:
        """How often each entry this worker holds was delivered, this read included: a worker
        restarted under the same name takes back its own entries, and a request that crashed
        it each time must reach the dead letters, not run forever at a count of 1."""
        rows = self.r.xpending_range(self.stream, GROUP, "-", "+", count, consumername=self.worker)
        return {as_text(r["message_id"]): int(r["times_delivered"]) for r in rows}

    def _parse(self, entry_id, fields: dict, deliveries: int) -> PulledRequest:
        fields = {as_text(k): as_text(v) for k, v in fields.items()}
        try:
            request = EngineRequest.from_json(fields["payload"])
        except Exception:  # a malformed entry must not stop the engine
            log.warning("malformed stream entry %s: %r", as_text(entry_id), fields)
            request = None
        return PulledRequest(as_text(entry_id), request, [], deliveries=deliveries, raw=fields)

    def _prepare(self, entries: list[tuple], deliveries: dict[str, int] | None = None):
        """Parse entries and, in one script, take them into service with each request's state
        and prior tokens (for entries this worker held before a restart, with their tails in
        its log moved into their lists first: TAKE_SCRIPT, one each; they are marked running
        when admitted)."""
        counts = deliveries or {}
        pulled = [self._parse(eid, f, counts.get(as_text(eid), 1)) for eid, f in entries]
        if deliveries is None:
            return self._take_fresh(pulled)
        live = [p for p in pulled if p.request is not None]
        if not live:
            return pulled
        pipe = script_pipeline(self.r)
        take = self._sha(TAKE_SCRIPT)
        for p in live:
            rid = p.request.id
            keys = (self.keys.req(rid), self.keys.tokens(rid))
            pipe.evalsha(take, 2, *keys, self.keys.log(self.worker), rid, self.keys.out(rid))
        for p, (state, tokens) in zip(live, pipe.execute(), strict=True):
            p.cancelled = state is not None and as_text(state) == "cancelled"
            set_prior_tokens(p, tokens)
        return pulled

    def _take_fresh(self, pulled: list[PulledRequest]) -> list[PulledRequest]:
        """New entries into service (PULLED_SCRIPT), in order; the ones refused (an entry its
        request no longer runs under, or another worker's) are dropped here, the unparsable
        ones kept (they fail when admitted)."""
        live = [p for p in pulled if p.request is not None]
        if not live:
            return pulled
        keys = [self.stream]
        for p in live:
            keys += [self.keys.req(p.request.id), self.keys.tokens(p.request.id)]
        args = [self.worker, time.time(), *(p.entry_id for p in live)]
        replies = self.r.evalsha(self._sha(PULLED_SCRIPT), len(keys), *keys, *args)
        dropped = set()
        for p, (refusal, state, tokens) in zip(live, replies, strict=True):
            if refusal != 0:
                owner = as_text(refusal).partition(":")[2] or "a new run of it"
                log.warning(
                    "request %s (entry %s) is %s's: dropped", p.request.id, p.entry_id, owner
                )
                dropped.add(id(p))
                continue
            p.cancelled = as_text(state) == "cancelled"
            p.running = not p.cancelled
            set_prior_tokens(p, tokens)
        return [p for p in pulled if id(p) not in dropped]

    def mark_running(self, pulled: Iterable[PulledRequest]) -> list[Refusal]:
        """Take the requests into service as their owner; refused: those another worker took
        over meanwhile (this one froze between pulling and admitting them)."""
        pulled = [p for p in pulled if p.request is not None]
        held = [p for p in pulled if p.running]  # taken into service as they were pulled
        rest = [p for p in pulled if not p.running]
        refused = []
        if rest:
            keys = [self.stream, *(self.keys.req(p.request.id) for p in rest)]
            args = [self.worker, time.time(), *(p.entry_id for p in rest)]
            replies = self.r.evalsha(self._sha(RUNNING_SCRIPT), len(keys), *keys, *args)
            for p, reply in zip(rest, replies, strict=True):
                if reply == 0:
                    held.append(p)
                else:
                    owner = as_text(reply).partition(":")[2]
                    refused.append(Refusal(p.request.id, p.entry_id, owner=owner))
        for p in held:
            self.writer.hold(p.request.id, p.entry_id, p.request.reply_to, len(p.prior_tokens))
        return refused

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
                elif data.startswith(HANDOVER_PREFIX):
                    if data == HANDOVER_PREFIX + self.worker:
                        self.handover_waiting = True
                else:
                    ids.append(data)
        return ids

    def announce_handback(self) -> None:
        """Tell the other engines that this worker, shutting down, left requests pending: they
        claim them at once instead of at their next periodic look for dead workers."""
        self.r.publish(self.keys.cancel, HANDBACK_PREFIX + self.worker)

    # ---- outputs back ----------------------------------------------------------------
    def emit(self, emissions: list[Emission]) -> list[Refusal]:
        """Record and publish one step's news for every request, one script a step
        (``StepWriter``). The writes refused: the requests another worker owns now, and
        those whose record lost its tail."""
        return self.writer.emit(emissions) if emissions else []

    def fail(
        self,
        request_id: str | None,
        entry_id: str,
        index: int,
        error: EngineError,
        reply_to: str = "",
    ) -> list[Refusal]:
        """End a request with an error its client sees (or just drop an unparsable entry)."""
        if request_id is None:
            pipe = self.r.pipeline(transaction=True)
            pipe.xack(self.stream, GROUP, entry_id)
            pipe.xdel(self.stream, entry_id)
            pipe.execute()
            return []
        msg = OutputMessage(index=index, error=error, worker=self.worker)
        return self.emit([Emission(request_id, entry_id, msg, reply_to)])

    def dead_letter(self, p: PulledRequest, reason: str) -> None:
        """Fail the request and set its entry aside in the dead letters (unless another worker
        owns it now)."""
        rid = p.request.id if p.request else None
        error = EngineError(reason, "server_error", "dead_letter")
        reply_to = p.request.reply_to if p.request else ""
        if self.fail(rid, p.entry_id, len(p.prior_tokens), error, reply_to):
            return
        fields = dict(p.raw or {})
        fields.update(reason=reason, deliveries=str(p.deliveries), entry=p.entry_id)
        self.r.xadd(self.keys.dead, fields, maxlen=10000, approximate=True)

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
        idle too. ``min_idle_ms`` makes a second claimer lose the race to the first. Counts
        the live ones on the way (``live_peers``)."""
        try:
            consumers = self.r.xinfo_consumers(self.stream, GROUP)
        except redis.ResponseError:
            return []
        claimed: list[PulledRequest] = []
        live = 0
        for c in consumers:
            name = as_text(c["name"])
            if name == self.worker:
                continue
            if self.r.exists(self.keys.engine(name)):
                live += 1
                continue
            if int(c.get("pending", 0)) == 0:
                if c.get("idle", 0) > min_idle_ms:
                    self.r.xgroup_delconsumer(self.stream, GROUP, name)
                continue
            if len(claimed) >= max_count:
                continue  # the next claim takes the rest; the live are still counted
            rows = self.r.xpending_range(
                self.stream, GROUP, "-", "+", max_count - len(claimed), consumername=name
            )
            if not rows:
                continue
            deliveries = {as_text(r["message_id"]): int(r["times_delivered"]) + 1 for r in rows}
            # Handed back: no need to wait out the idle time that tells a dead worker from a
            # busy one (a short one still makes a second claimer lose the race).
            idle = _HANDBACK_IDLE_MS if name in self.handed_back else min_idle_ms
            got = self._claim(deliveries, idle)
            if got:
                log.warning("claimed %d requests from dead worker %s", len(got), name)
            claimed.extend(got)
        self.handed_back.clear()
        self.live_peers = live
        self._note_taken(claimed)
        return claimed

    def _claim(self, deliveries: dict[str, int], idle_ms: int) -> list[PulledRequest]:
        """Claim entries with their requests, one atomic CLAIM_SCRIPT each (an entry whose
        request cannot be named, one deleted meanwhile or unparsable, by a plain XCLAIM)."""
        ids = list(deliveries)
        pipe = script_pipeline(self.r)
        for eid in ids:  # each entry's request id (an entry never changes), to name its keys
            pipe.xrange(self.stream, eid, eid)
        rids = [entry_request_id(hits) for hits in pipe.execute()]
        sha = self._sha(CLAIM_SCRIPT)
        for eid, rid in zip(ids, rids, strict=True):
            if rid is None:
                pipe.xclaim(self.stream, GROUP, self.worker, idle_ms, [eid])
            else:
                k = self.keys
                keys = (self.stream, k.req(rid), k.tokens(rid))
                args = (GROUP, self.worker, idle_ms, eid, k.log_prefix, rid, self.request_ttl)
                args += (k.out(rid),)
                pipe.evalsha(sha, 3, *keys, *args)
        claimed: list[PulledRequest] = []
        for eid, rid, reply in zip(ids, rids, pipe.execute(), strict=True):
            if rid is None:  # entries deleted meanwhile come back as nil / empty
                for got_id, fields in reply:
                    if fields:
                        claimed.append(self._parse(got_id, fields, deliveries[eid]))
                    else:
                        self.r.xack(self.stream, GROUP, got_id)
            elif isinstance(reply, list):  # else not claimed, or 'stale' (dropped)
                raw, state, tokens = reply
                p = self._parse(eid, dict(zip(raw[::2], raw[1::2], strict=True)), deliveries[eid])
                p.cancelled = as_text(state) == "cancelled"
                set_prior_tokens(p, tokens)
                claimed.append(p)
        return claimed
