"""The worker's heartbeat, on a thread and a timer of its own: the engine loop only hands it
status snapshots. Written between engine steps, a heartbeat lapsed during any step longer than
its TTL (a big prefill on a CPU), and other workers then took over the requests of a worker
that was still running them. A process that is frozen (SIGSTOP, a VM paused) stops this thread
too, which is what lets the others take its requests over."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from llmq.common.engine_status import EngineStatus
from llmq.worker.engine_queue import EngineQueue

log = logging.getLogger(__name__)

_STATS_WINDOW_S = 10.0  # the rates in the heartbeat are averages over this much time


class Heartbeat:
    def __init__(
        self, transport: EngineQueue, status: EngineStatus, ttl: float, stall_timeout: float = 0.0
    ):
        self.transport = transport
        self.ttl = ttl
        self.interval = min(1.0, ttl / 3)
        # On a thread of its own the heartbeat would outlive a loop that hangs (a deadlock, a
        # step that never returns) and keep that loop's requests from everyone: past this many
        # seconds without a turn it is withheld, and others take them over (fenced, so a loop
        # that was only slow drops them). 0: never.
        self.stall_timeout = stall_timeout
        self._progress = time.monotonic()
        self._stalled = False
        self._status = dataclasses.replace(status)  # the snapshot the thread writes
        self._window: list[tuple[float, int, int]] = []  # (time, steps, tokens)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def update(self, status: EngineStatus, stats: dict, now: float) -> None:
        """Fold the backend's stats into ``status`` (the rates over the last seconds) and hand
        the thread a copy of it (a new object: the thread never reads one half written), to
        write at once: a heartbeat is then never more than one refresh old (written only on the
        thread's tick it could be two, and a reader saw counts from before its last request)."""
        steps, tokens = stats.get("steps_total", 0), stats.get("tokens_total", 0)
        self._window.append((now, steps, tokens))
        self._window = [w for w in self._window if now - w[0] <= _STATS_WINDOW_S]
        t0, s0, g0 = self._window[0]
        span = now - t0
        status.update(
            **stats,
            steps_per_s=round((steps - s0) / span, 2) if span > 0 else 0.0,
            tokens_per_s=round((tokens - g0) / span, 2) if span > 0 else 0.0,
            updated=round(now, 3),
        )
        self._status = dataclasses.replace(status)
        self._wake.set()

    def beat(self) -> None:
        """Write the latest snapshot now (on the caller's thread)."""
        self.transport.heartbeat(self._status, self.ttl)

    def progress(self) -> None:
        """The loop made a turn (or a step): it is not stalled."""
        self._progress = time.monotonic()

    def stalled(self) -> bool:
        """Whether the loop has made no turn for longer than ``stall_timeout`` (logged once)."""
        idle = time.monotonic() - self._progress
        stalled = self.stall_timeout > 0 and idle > self.stall_timeout
        if stalled and not self._stalled:
            log.error(
                "engine loop made no progress for %.0fs: heartbeat withheld, other workers "
                "take its requests over",
                idle,
            )
        elif self._stalled and not stalled:
            log.warning("engine loop turning again: heartbeat resumed")
        self._stalled = stalled
        return stalled

    def beat_soon(self) -> None:
        """Have the thread write the latest snapshot now, not at its next tick."""
        self._wake.set()

    def start(self) -> None:
        self._stop.clear()
        self._progress = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="llmq-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, so that it writes nothing after this returns (a heartbeat removed
        then stays removed)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.ttl + 5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.stalled():
                    self.beat()
                if self._failing:
                    log.info("heartbeat written again")
                self._failing = False
            except Exception as exc:  # Redis away: the loop deals with it; keep trying
                if not self._failing:
                    log.warning("heartbeat not written: %s", exc)
                self._failing = True
            self._wake.wait(self.interval)
            self._wake.clear()
