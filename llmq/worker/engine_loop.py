"""The engine loop: requests in, model steps, outputs out. Runs in its own thread in the worker.

Each turn: pull as many requests as the engine has room for (blocking only when idle), drain
cancels, run one engine step, publish every sequence's new tokens in one round trip, refresh
the heartbeat's status, and now and then take over the requests of workers whose heartbeat
expired. The heartbeat itself is written by a thread of its own (``heartbeat.py``). A write
the transport refuses because another worker took a request over stops the request here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmq.common.engine_status import EngineStatus
from llmq.common.protocol import PRIORITY_INTERACTIVE, EngineError, EngineRequest, OutputMessage
from llmq.common.transport import Emission, PulledRequest, Refusal
from llmq.worker.backends import Backend
from llmq.worker.cache_report import PLACEMENT_IDLE_BLOCK_MS, CacheReport
from llmq.worker.coalescer import Coalescer
from llmq.worker.engine_queue import EngineQueue
from llmq.worker.failed_step import step_one_by_one
from llmq.worker.heartbeat import Heartbeat
from llmq.worker.record_mend import mend_record
from llmq.worker.request_error import RequestError

_MAX_BACKOFF_S = 2.0  # between turns that Redis refused

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Active:
    request: EngineRequest
    request_id: str
    entry_id: str
    deadline: float | None
    created: float
    started: float
    priority: int = PRIORITY_INTERACTIVE
    held: OutputMessage | None = None  # batch-priority tokens not yet sent


# Batch-job requests publish (and record) their tokens in groups: nobody watches them token by
# token, and every message costs the worker process Python time that interactive requests need.
BATCH_EMIT_EVERY = 16


class EngineLoop:
    def __init__(
        self,
        backend: Backend,
        transport: EngineQueue,
        status: EngineStatus,
        heartbeat_ttl: float = 5.0,
        max_deliveries: int = 3,
        idle_block_ms: int = 100,
        clock: Callable[[], float] = time.time,
        stall_timeout: float = 0.0,
        stream_interval_s: float = 0.0,
    ):
        self.backend = backend
        self.transport = transport
        self.status = status
        self.heartbeat_ttl = heartbeat_ttl
        self.max_deliveries = max_deliveries
        self.idle_block_ms = idle_block_ms
        if transport.placement:
            self.idle_block_ms = min(idle_block_ms, PLACEMENT_IDLE_BLOCK_MS)
        self.clock = clock  # wall time: deadlines are unix times
        # Requests taken per turn, at most: a burst is split among the engines serving the
        # model as they turn, not swallowed whole by the first one that finds it. An engine
        # with no live peer takes all it has room for, which halves a burst's TTFT p99
        # (docs/performance.md, "Choices: serving").
        self.pull_per_turn = max(1, backend.max_batch_size // 8)
        self.active: dict[str, Active] = {}
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self.heartbeat = Heartbeat(transport, status, heartbeat_ttl, stall_timeout)
        self._last_status = 0.0
        self._last_claim = 0.0
        self._last_deadline_check = 0.0
        self.grace_period = 5.0
        self._unsent: list[Emission] = []  # emissions a Redis outage kept from going out
        self.coalescer = Coalescer(stream_interval_s, clock)
        self._set_up = False  # the transport is set up (false at start and after an outage)
        # Its cached set outlives a heartbeat gap of a few TTLs; gone with a dead worker.
        self.cache_report = CacheReport(transport, backend, max(heartbeat_ttl * 3, 15.0))

    # ---- lifecycle -----------------------------------------------------------------------
    def run(self) -> None:
        """Serve until ``stop()``; survives Redis outages by retrying. Should anything else end
        it, the heartbeat goes with it: other workers take its requests over, and the worker
        (see celery_app.EngineStep) exits rather than answer pings with no engine behind it."""
        self.heartbeat.start()
        try:
            self._serve()
            self._drain()
        except BaseException:
            log.exception("engine loop crashed")
            self.heartbeat.stop()
            with contextlib.suppress(Exception):
                self.transport.remove_heartbeat()
            raise
        finally:
            self.heartbeat.stop()
            self.stopped.set()

    def _serve(self) -> None:
        backoff = 0.2
        while not self.stopping.is_set():
            error = self.turn()
            self.heartbeat.progress()  # a turn, even one Redis refused: the loop is not stuck
            if error is None:
                backoff = 0.2
                continue
            log.warning("redis unavailable or refusing (%s); retrying in %.1fs", error, backoff)
            self.stopping.wait(backoff)
            # At most 2 s: serving resumes within that of Redis taking writes again (a failover,
            # maxmemory raised), for one connection attempt a retry.
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    def turn(self) -> Exception | None:
        """One turn, setting the transport up first where it is not (at start, after an
        outage). A transient transport error closes the transport and is returned: the next
        turn sets it up again and resumes the requests this worker holds."""
        try:
            if not self._set_up:
                self.transport.setup(self.status)
                self.heartbeat.beat()  # at once: it says this worker is alive, serving
                self._resume(
                    self.transport.pull(self.backend.max_batch_size * 4, None, own_pending=True)
                )
                self._set_up = True
            if self._unsent:
                self._publish([])
            self._advance()
        except self.transport.transient_errors as exc:
            self.transport.close()
            self._set_up = False
            return exc
        return None

    def stop(self, grace_period: float | None = None) -> None:
        if grace_period is not None:
            self.grace_period = grace_period
        self.stopping.set()

    def _drain(self) -> None:
        """Warm shutdown: take nothing new, finish what fits in the grace period, and leave the
        rest un-acked (with the heartbeat removed) so a live worker resumes it."""
        deadline = time.monotonic() + self.grace_period
        try:
            while self.backend.has_unfinished() and time.monotonic() < deadline:
                self._step()
                self.heartbeat.progress()
                self._refresh_status(self.clock())
            left = list(self.active)
            for rid in left:
                self.backend.abort(rid)
            self.heartbeat.stop()  # nothing may write it again once it is removed
            self.transport.remove_heartbeat()
            if left:
                log.warning("handing back %d unfinished requests", len(left))
                self.transport.announce_handback()
        except self.transport.transient_errors:
            log.warning("redis unavailable during shutdown; unfinished requests stay pending")
        finally:
            self.transport.close()

    # ---- one turn ------------------------------------------------------------------------
    def _advance(self) -> None:
        """Pull, cancel, check deadlines, step and emit, heartbeat, claim orphans."""
        now = self.clock()
        busy = self.backend.has_unfinished()
        room = self.backend.room()
        if room > 0:
            alone = self.transport.live_peers == 0
            pulled = self.transport.pull(
                room if alone else min(room, self.pull_per_turn),
                None if busy else self.idle_block_ms,
            )
            if pulled:
                self._admit(pulled)
        cancelled = self.transport.drain_cancels()
        if self.transport.handover_waiting and (room := self.backend.room()) > 0:
            self._resume(self.transport.pull_handed(room))
        if self.transport.handed_back:
            self._last_claim = 0.0  # a worker shutting down left requests: take them now
        for rid in cancelled:
            self._abort(rid, reason=None)
        if cancelled:  # show the freed blocks now, not a second later
            self._last_status = 0.0
        if now - self._last_deadline_check > 0.5:
            self._check_deadlines(now)
        if self.backend.has_unfinished():
            self._step()
        if self._refresh_status(now) and cancelled:
            self.heartbeat.beat_soon()
        if now - self._last_claim > self.heartbeat_ttl / 2:
            self._last_claim = now
            self.transport.handover_waiting |= self.transport.placement  # a notice missed
            self._resume(
                self.transport.claim_orphans(int(self.heartbeat_ttl * 1000), max(room, 1) * 4)
            )

    def _step(self) -> None:
        try:
            news = self.backend.step()
        except Exception:  # one bad request must not fail everyone's
            log.exception("engine step failed; stepping its requests one by one")
            news = self._step_one_by_one()
        emissions = [e for rid, msg in news if (e := self._emission(rid, msg)) is not None]
        if emissions or self._unsent or self.coalescer.due():
            self._publish(emissions)

    def _publish(self, emissions: list[Emission]) -> None:
        """Send emissions, after any an outage held back; on failure keep them all for the
        next try (writes are idempotent and clients drop repeats)."""
        self._unsent.extend(self.coalescer.take(emissions))
        if not self._unsent:
            return
        refused = self.transport.emit(self._unsent)
        self._unsent = []
        for r in refused:
            self._refused(r)

    def _refused(self, r: Refusal) -> None:
        """A write refused: the request is another worker's now (it stops here), or its record
        lost its tail (mended from this worker's own tokens where it can, else failed: the
        next tokens would land at the wrong positions)."""
        if r.owner is not None:
            self.coalescer.drop(r.request_id)
            if self.active.pop(r.request_id, None) is not None:
                self.backend.abort(r.request_id)
            log.warning(
                "request %s was claimed by %s (this worker's heartbeat lapsed): dropped here",
                r.request_id,
                r.owner or "a new run of it",
            )
            return
        active = self.active.get(r.request_id)
        if mend_record(self.transport, self.backend, r, active.request if active else None):
            return
        active = self.active.pop(r.request_id, None)
        if active is not None:
            self.backend.abort(r.request_id)
        log.error(
            "request %s: its record in Redis holds %d tokens, fewer than were sent (Redis "
            "lost the tail of it); failing it",
            r.request_id,
            r.recorded,
        )
        error = EngineError(
            f"the request's output record lost its last tokens ({r.recorded} are left); "
            "retry the request",
            "server_error",
            "output_record_lost",
        )
        reply_to = active.request.reply_to if active is not None else ""
        self.transport.fail(r.request_id, r.entry_id, r.recorded or 0, error, reply_to)

    def _step_one_by_one(self) -> list[tuple[str, OutputMessage]]:
        """After a step raised: the news of its requests stepped alone; the ones at fault
        fail with the error they raise."""
        result = step_one_by_one(self.backend, {r: a.request for r, a in self.active.items()})
        for rid, (index, exc) in result.failed.items():
            active = self.active.pop(rid)
            error = EngineError(
                f"the engine failed on this request: {exc}", "server_error", "engine_error"
            )
            msg = OutputMessage(index=index, finish_reason="abort", error=error)
            self._publish([Emission(rid, active.entry_id, msg, active.request.reply_to)])
        return result.news

    def _emission(self, request_id: str, msg: OutputMessage) -> Emission | None:
        active = self.active[request_id]
        if active.priority > PRIORITY_INTERACTIVE and msg.error is None:
            if active.held is not None:
                held = active.held
                held.tokens = held.tokens + msg.tokens
                if held.logprobs is not None or msg.logprobs is not None:
                    held.logprobs = (held.logprobs or []) + (msg.logprobs or [])
                held.finish_reason, held.usage = msg.finish_reason, msg.usage
                msg = held
            if not msg.done and len(msg.tokens) < BATCH_EMIT_EVERY:
                active.held = msg
                return None
            active.held = None
        if msg.done:
            del self.active[request_id]
            self.cache_report.finished(msg)
            msg.worker = self.transport.worker
            if msg.usage is not None and active.created:
                msg.usage["queue_time"] = round(max(0.0, active.started - active.created), 4)
        return Emission(request_id, active.entry_id, msg, active.request.reply_to)

    # ---- admission -----------------------------------------------------------------------
    def _resume(self, pulled: list[PulledRequest]) -> None:
        fresh = [p for p in pulled if p.request is None or p.request.id not in self.active]
        for p in fresh:
            if p.deliveries > self.max_deliveries:
                rid = p.request.id if p.request is not None else f"entry {p.entry_id}"
                log.error("request %s delivered %d times; dead-lettered", rid, p.deliveries)
                self.transport.dead_letter(p, f"delivered {p.deliveries} times without finishing")
        self._admit([p for p in fresh if p.deliveries <= self.max_deliveries])

    def _admit(self, pulled: list[PulledRequest]) -> None:
        now = self.clock()
        admitted: list[PulledRequest] = []
        for p in pulled:
            req = p.request
            if req is None:  # its client, if it has one, learns why (the entry names its id)
                rid = (p.raw or {}).get("id") or None
                error = EngineError("malformed request", "invalid_request_error")
                self.transport.fail(rid, p.entry_id, 0, error)
                continue
            if p.cancelled:
                self.transport.fail(
                    req.id,
                    p.entry_id,
                    len(p.prior_tokens),
                    EngineError("cancelled", "cancelled", "cancelled"),
                    req.reply_to,
                )
                continue
            if req.deadline is not None and now > req.deadline:
                error = _deadline_error()
                self.transport.fail(req.id, p.entry_id, len(p.prior_tokens), error, req.reply_to)
                continue
            try:
                self.backend.add(req, p.prior_tokens)
            except Exception as exc:  # RequestError, or an entry of the wrong types
                if not isinstance(exc, RequestError):
                    log.warning("request %s refused by the engine: %r", req.id, exc)
                    self.backend.abort(req.id)
                self.transport.fail(
                    req.id,
                    p.entry_id,
                    len(p.prior_tokens),
                    EngineError(f"invalid request: {exc}", "invalid_request_error"),
                    req.reply_to,
                )
                continue
            if p.prior_tokens:
                log.info("resuming %s after %d tokens", req.id, len(p.prior_tokens))
            self.active[req.id] = Active(
                req, req.id, p.entry_id, req.deadline, req.created, self.clock(), req.priority
            )
            admitted.append(p)
        if admitted:
            for r in self.transport.mark_running(admitted):
                self._refused(r)

    def _abort(self, request_id: str, reason: EngineError | None) -> None:
        active = self.active.pop(request_id, None)
        msg = self.backend.abort(request_id)
        if active is None or msg is None:
            return
        if reason is None:  # an error says why itself; a cancel is logged here
            log.info(
                "request %s cancelled (its client left or a stop string ended it) after %.1fs",
                request_id,
                self.clock() - active.started,
            )
        msg.error = reason
        self._publish([Emission(request_id, active.entry_id, msg, active.request.reply_to)])

    def _check_deadlines(self, now: float) -> None:
        self._last_deadline_check = now
        for rid, a in list(self.active.items()):
            if a.deadline is not None and now > a.deadline:
                log.info("request %s passed its deadline", rid)
                self._abort(rid, _deadline_error())

    def _refresh_status(self, now: float) -> bool:
        """Hand the heartbeat a fresh status, once per heartbeat interval."""
        if now - self._last_status <= self.heartbeat.interval:
            return False
        self._last_status = now
        stats = {**self.backend.stats(), **self.cache_report.fields()}
        self.heartbeat.update(self.status, stats, now)
        self.cache_report.publish()
        return True


def _deadline_error() -> EngineError:
    return EngineError("the request passed its deadline", "timeout", "deadline_exceeded")
