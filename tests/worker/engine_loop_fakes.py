"""An in-memory EngineQueue and a scripted Backend (no Redis, no torch), for driving the engine
loop turn by turn in unit tests."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from llmq.common.engine_status import EngineStatus
from llmq.common.protocol import PRIORITY_INTERACTIVE, EngineError, EngineRequest, OutputMessage
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import Emission, PulledRequest, Refusal
from llmq.worker.engine_loop import EngineLoop
from llmq.worker.request_error import RequestError

T0 = 1_000_000.0


class Outage(Exception):
    """The in-memory queue's transient error (Redis's ConnectionError in service)."""


@dataclass
class Failure:
    request_id: str | None
    entry_id: str
    index: int
    error: EngineError


@dataclass
class MemoryQueue:
    """An EngineQueue in memory: serves pulls from a list and records what the loop sends."""

    worker: str = "w1"
    handed_back: set[str] = field(default_factory=set)
    live_peers: int | None = None
    placement: bool = False
    handover_waiting: bool = False
    handed: list[PulledRequest] = field(default_factory=list)  # handed over, not yet taken
    published: list[set[int]] = field(default_factory=list)  # each publish_cached's hashes
    transient_errors: tuple[type[Exception], ...] = (Outage,)
    waiting: list[PulledRequest] = field(default_factory=list)  # not yet delivered
    held: dict[str, PulledRequest] = field(default_factory=dict)  # delivered, not acked
    orphans: list[PulledRequest] = field(default_factory=list)  # for the next claim
    cancels: list[str] = field(default_factory=list)  # for the next drain
    pulls: list[tuple[int, int | None, bool]] = field(default_factory=list)
    emitted: list[Emission] = field(default_factory=list)
    acked: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    dead: list[tuple[str, str]] = field(default_factory=list)  # (entry id, reason)
    running: list[str] = field(default_factory=list)
    heartbeats: list[EngineStatus] = field(default_factory=list)
    owners: dict[str, str] = field(default_factory=dict)  # request id -> the worker that claimed it
    records: dict[str, list[int]] = field(default_factory=dict)  # request id -> tokens recorded
    claims: int = 0
    setups: int = 0
    closes: int = 0
    heartbeat_removed: bool = False
    handback_announced: bool = False
    outage_in: str | None = None  # the next call of this method raises Outage

    def _call(self, name: str) -> None:
        if self.outage_in == name:
            self.outage_in = None
            raise Outage(f"{name}: connection refused")

    def setup(self, status: EngineStatus | None = None) -> None:
        self._call("setup")
        self.setups += 1

    def close(self) -> None:
        self.closes += 1

    def pull(
        self, count: int, block_ms: int | None, own_pending: bool = False
    ) -> list[PulledRequest]:
        self._call("pull")
        self.pulls.append((count, block_ms, own_pending))
        if own_pending:
            return list(self.held.values())[:count]
        taken, self.waiting = self.waiting[:count], self.waiting[count:]
        self.held.update((p.entry_id, p) for p in taken)
        return taken

    def pull_handed(self, count: int) -> list[PulledRequest]:
        self._call("pull_handed")
        self.handover_waiting = len(self.handed) > count
        taken, self.handed = self.handed[:count], self.handed[count:]
        self.held.update((p.entry_id, p) for p in taken)
        return taken

    def publish_cached(self, hashes: Iterable[int], ttl: float) -> None:
        self.published.append(set(hashes))

    def mark_running(self, pulled: Iterable[PulledRequest]) -> list[Refusal]:
        refused = [self._fenced(p.request.id, p.entry_id) for p in pulled]
        self.running.extend(p.request.id for p, r in zip(pulled, refused, strict=True) if not r)
        return [r for r in refused if r]

    def _fenced(self, request_id: str, entry_id: str) -> Refusal | None:
        owner = self.owners.get(request_id)
        return None if owner in (None, self.worker) else Refusal(request_id, entry_id, owner)

    def drain_cancels(self) -> list[str]:
        self._call("drain_cancels")
        cancels, self.cancels = self.cancels, []
        return cancels

    def announce_handback(self) -> None:
        self.handback_announced = True

    def emit(self, emissions: list[Emission]) -> list[Refusal]:
        """Like the Redis transport's: the owner checked, tokens recorded idempotently, and a
        record shorter than a message's index (its tail lost) refused."""
        self._call("emit")
        refused = []
        for e in emissions:
            msg, record = e.message, self.records.setdefault(e.request_id, [])
            if fenced := self._fenced(e.request_id, e.entry_id):
                refused.append(fenced)
                continue
            if msg.tokens and len(record) < msg.index:
                refused.append(Refusal(e.request_id, e.entry_id, recorded=len(record), message=msg))
                continue
            record.extend(msg.tokens[len(record) - msg.index :] if msg.tokens else [])
            self.emitted.append(e)
            if msg.done:
                self._ack(e.entry_id)
        return refused

    def _ack(self, entry_id: str) -> None:
        self.held.pop(entry_id, None)
        self.acked.append(entry_id)

    def fail(
        self,
        request_id: str | None,
        entry_id: str,
        index: int,
        error: EngineError,
        reply_to: str = "",
    ) -> list[Refusal]:
        if request_id is not None and (fenced := self._fenced(request_id, entry_id)):
            return [fenced]
        self.failures.append(Failure(request_id, entry_id, index, error))
        self._ack(entry_id)
        return []

    def dead_letter(self, p: PulledRequest, reason: str) -> None:
        self.dead.append((p.entry_id, reason))
        self._ack(p.entry_id)

    def heartbeat(self, status: EngineStatus, ttl: float) -> None:
        self.heartbeats.append(replace(status))

    def remove_heartbeat(self) -> None:
        self.heartbeat_removed = True

    def claim_orphans(self, min_idle_ms: int, max_count: int) -> list[PulledRequest]:
        self.claims += 1
        claimed, self.orphans = self.orphans, []
        self.held.update((p.entry_id, p) for p in claimed)
        self.handed_back.clear()
        return claimed

    # ---- what the tests read ---------------------------------------------------------
    def messages(self, request_id: str) -> list[OutputMessage]:
        return [e.message for e in self.emitted if e.request_id == request_id]

    def failure(self, request_id: str) -> Failure:
        (found,) = [f for f in self.failures if f.request_id == request_id]
        return found


def token(request_id: str, index: int) -> int:
    """The scripted backend's deterministic token at a position."""
    return 1000 * int(request_id.removeprefix("r")) + index


class ScriptedBackend:
    """A Backend that generates ``token(id, i)`` one per step until ``max_tokens``."""

    kind = "generate"

    def __init__(self, max_batch_size: int = 16, capacity: int | None = None):
        self.max_batch_size = max_batch_size
        self.capacity = max_batch_size if capacity is None else capacity
        self.requests: dict[str, tuple[int, int]] = {}  # id -> (generated, max_tokens)
        self.raise_on_step: Exception | None = None
        self.raise_for: set[str] = set()  # a step with any of these requests raises
        self.steps = 0

    def room(self) -> int:
        return self.capacity - len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, request: EngineRequest, prior_tokens: list[int]) -> None:
        if not request.prompt_token_ids:
            raise RequestError("the prompt is empty")
        self.requests[request.id] = (len(prior_tokens), request.params.max_tokens)

    def abort(self, request_id: str) -> OutputMessage | None:
        if request_id not in self.requests:
            return None
        generated, _ = self.requests.pop(request_id)
        return OutputMessage(index=generated, finish_reason="abort")

    def take(self, request_id: str) -> list[int] | None:
        if request_id not in self.requests:
            return None
        generated, _ = self.requests.pop(request_id)
        return [token(request_id, i) for i in range(generated)]

    def output_tokens(self, request_id: str) -> list[int] | None:
        if request_id not in self.requests:
            return None
        return [token(request_id, i) for i in range(self.requests[request_id][0])]

    def step(self) -> list[tuple[str, OutputMessage]]:
        if self.raise_on_step is not None:
            exc, self.raise_on_step = self.raise_on_step, None
            raise exc
        if faulty := sorted(self.raise_for & set(self.requests)):
            raise RuntimeError(f"bad values in {faulty[0]}")
        self.steps += 1
        news = []
        for rid, (generated, max_tokens) in list(self.requests.items()):
            msg = OutputMessage(index=generated, tokens=[token(rid, generated)])
            generated += 1
            self.requests[rid] = (generated, max_tokens)
            if generated == max_tokens:
                del self.requests[rid]
                msg.finish_reason = "length"
                msg.usage = {"prompt_tokens": 1, "completion_tokens": generated}
            news.append((rid, msg))
        return news

    def stats(self) -> dict:
        return {"running": len(self.requests), "steps_total": self.steps}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def pulled(
    n: int,
    max_tokens: int = 100,
    *,
    priority: int = PRIORITY_INTERACTIVE,
    deadline: float | None = None,
    deliveries: int = 1,
    cancelled: bool = False,
    prompt: list[int] | None = None,
) -> PulledRequest:
    request = EngineRequest(
        f"r{n}",
        [1, 2, 3] if prompt is None else prompt,
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
        deadline=deadline,
        created=T0 - 1,
    )
    return PulledRequest(f"e{n}", request, [], cancelled=cancelled, deliveries=deliveries)


def make_loop(
    backend: ScriptedBackend | None = None,
    max_deliveries: int = 3,
    heartbeat_ttl: float = 5.0,
    stall_timeout: float = 0.0,
    stream_interval_s: float = 0.0,
    placement: bool = False,
) -> tuple[EngineLoop, MemoryQueue, ScriptedBackend, Clock]:
    queue, clock = MemoryQueue(placement=placement, handover_waiting=placement), Clock()
    backend = backend or ScriptedBackend()
    loop = EngineLoop(
        backend,
        queue,
        EngineStatus(model="m"),
        heartbeat_ttl=heartbeat_ttl,
        max_deliveries=max_deliveries,
        clock=clock,
        stall_timeout=stall_timeout,
        stream_interval_s=stream_interval_s,
    )
    return loop, queue, backend, clock


def turn(loop: EngineLoop) -> None:
    assert loop.turn() is None
