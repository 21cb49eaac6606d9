"""The servers' process trees, sampled: peak resident memory (VmRSS summed over every process
in the server's process group or below it; and PSS, which counts a page shared by n of them,
such as torch's libraries in two workers, once in all, 1/n in each) and the CPU time they used,
beside how busy the whole machine was. Used by bench/compare.py and bench/structured.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path

CLK = os.sysconf("SC_CLK_TCK")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, utime+stime ticks) of a process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()
    return int(rest[1]), int(rest[2]), int(rest[11]) + int(rest[12])


def tree(root: int) -> dict[int, int]:
    """Every live process in the root's process group or below it: pid -> CPU ticks."""
    info = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(int(d))
            if st:
                info[int(d)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in info.items():
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, (_, pgid, _) in info.items() if pgid == root}
    if root in info:
        found.add(root)
    stack = list(found)
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in found:
                found.add(c)
                stack.append(c)
    return {pid: info[pid][2] for pid in found if pid in info}


def _kib(path: str, field: str) -> int:
    """A ``field:  N kB`` line of a /proc file, or 0 (a process gone meanwhile)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kib(pid: int) -> int:
    return _kib(f"/proc/{pid}/status", "VmRSS")


def pss_kib(pid: int) -> int:
    """Proportional set size: the process's resident pages, each shared one divided among
    the processes that map it (a sum over processes counts every page once)."""
    return _kib(f"/proc/{pid}/smaps_rollup", "Pss")


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


class Sampler:
    """Samples the server tree every ``interval`` s: peak RSS (overall and since ``mark``), the
    pids seen (so they can be stopped by id), and the CPU ticks each has used."""

    def __init__(self, root: int, interval: float = 0.5):
        self.root = root
        self.interval = interval
        self.peak_kib = 0
        self.window_peak_kib = 0
        self.peak_pss_kib = 0
        self.window_peak_pss_kib = 0
        self.pids: set[int] = set()
        self.ticks: dict[int, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        procs = tree(self.root)
        total = sum(rss_kib(p) for p in procs)
        pss = sum(pss_kib(p) for p in procs)
        with self._lock:
            self.pids |= set(procs)
            self.ticks.update(procs)
            self.peak_kib = max(self.peak_kib, total)
            self.window_peak_kib = max(self.window_peak_kib, total)
            self.peak_pss_kib = max(self.peak_pss_kib, pss)
            self.window_peak_pss_kib = max(self.window_peak_pss_kib, pss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def mark(self) -> tuple[int, tuple[int, int]]:
        """Start a window: reset the window's peak; returns (server ticks, machine ticks)."""
        self.sample()
        with self._lock:
            self.window_peak_kib = self.window_peak_pss_kib = 0
            return sum(self.ticks.values()), machine_busy_ticks()

    def window(self, start) -> dict:
        self.sample()
        ticks0, (busy0, tot0) = start
        with self._lock:
            ticks = sum(self.ticks.values()) - ticks0
            peak, peak_pss = self.window_peak_kib, self.window_peak_pss_kib
        busy1, tot1 = machine_busy_ticks()
        ncpu = cores()
        wall_ticks = (tot1 - tot0) / max(1, os.cpu_count() or 1)
        return {
            "peak_rss_gib": peak / 2**20,
            "peak_pss_gib": peak_pss / 2**20,
            "server_cpu_s": ticks / CLK,
            "server_cores": ticks / wall_ticks if wall_ticks else None,
            "machine_busy_cores": (busy1 - busy0) / wall_ticks if wall_ticks else None,
            "cores": ncpu,
        }

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
