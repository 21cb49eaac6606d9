"""How many cores the rest of the machine leaves idle, from Linux's /proc/stat.

A CPU worker with few streams runs latency-bound steps that go faster on more threads, but only
if those cores are free: two workers that both widen their steps onto the same cores stall each
other at every parallel region, which cut output severalfold (docs/performance.md, "Choices:
serving").
The machine's busy time minus this process's own says what everyone else uses.
"""

from __future__ import annotations

import os
import time

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float | None:
    """Seconds all cores spent busy since boot (None where /proc/stat is not there)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...
    ticks = [int(x) for x in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / _CLOCK_TICKS


class SpareCores:
    """``spare()``: cores the rest of the machine left idle over the last ``window_s`` or so,
    refreshed at most once a window (reading /proc/stat costs tens of microseconds)."""

    def __init__(self, cores: int, window_s: float = 0.25):
        self.cores = cores
        self.window_s = window_s
        self._last: tuple[float, float, float] | None = None  # wall, machine busy, own CPU
        self._spare = 0.0

    def spare(self) -> float:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.window_s:
            return self._spare
        busy = _machine_busy_s()
        if busy is None:
            return 0.0
        times = os.times()
        own = times.user + times.system
        if self._last is not None:
            wall = now - self._last[0]
            others = max(0.0, (busy - self._last[1]) - (own - self._last[2])) / wall
            self._spare = max(0.0, self.cores - others)
        self._last = (now, busy, own)
        return self._spare
