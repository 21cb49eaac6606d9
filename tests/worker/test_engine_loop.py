"""The engine loop turn by turn, on an in-memory queue and a scripted backend (no Redis, no
torch): admission, cancels, deadlines, dead letters, batch emission, failing steps, outages
and the hand-back at shutdown."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import pytest

from llmq.common.engine_status import EngineStatus
from llmq.common.protocol import (
    PRIORITY_BATCH,
    PRIORITY_INTERACTIVE,
    EngineError,
    EngineRequest,
    OutputMessage,
)
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import Emission, PulledRequest
from llmq.worker.engine_loop import BATCH_EMIT_EVERY, EngineLoop
from llmq.worker.request_error import RequestError

pytestmark = pytest.mark.unit

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

    def mark_running(self, pulled: Iterable[PulledRequest]) -> None:
        self.running.extend(p.request.id for p in pulled)

    def drain_cancels(self) -> list[str]:
        self._call("drain_cancels")
        cancels, self.cancels = self.cancels, []
        return cancels

    def announce_handback(self) -> None:
        self.handback_announced = True

    def emit(self, emissions: list[Emission]) -> None:
        self._call("emit")
        self.emitted.extend(emissions)
        for e in emissions:
            if e.message.done:
                self._ack(e.entry_id)

    def _ack(self, entry_id: str) -> None:
        self.held.pop(entry_id, None)
        self.acked.append(entry_id)

    def fail(self, request_id: str | None, entry_id: str, index: int, error: EngineError) -> None:
        self.failures.append(Failure(request_id, entry_id, index, error))
        self._ack(entry_id)

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

    def step(self) -> list[tuple[str, OutputMessage]]:
        if self.raise_on_step is not None:
            exc, self.raise_on_step = self.raise_on_step, None
            raise exc
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
    backend: ScriptedBackend | None = None, max_deliveries: int = 3
) -> tuple[EngineLoop, MemoryQueue, ScriptedBackend, Clock]:
    queue, clock = MemoryQueue(), Clock()
    backend = backend or ScriptedBackend()
    loop = EngineLoop(
        backend,
        queue,
        EngineStatus(model="m"),
        heartbeat_ttl=5.0,
        max_deliveries=max_deliveries,
        clock=clock,
    )
    return loop, queue, backend, clock


def turn(loop: EngineLoop) -> None:
    assert loop.turn() is None


# ---- admission ---------------------------------------------------------------------------
def test_admission_takes_pull_per_turn_up_to_the_room_left():
    # pull_per_turn is max_batch_size // 8 = 2; room() is what capacity leaves
    loop, queue, backend, _ = make_loop(ScriptedBackend(max_batch_size=16, capacity=5))
    assert loop.pull_per_turn == 2
    queue.waiting = [pulled(i) for i in range(8)]
    table = []
    for _ in range(5):
        before = len(queue.pulls)
        turn(loop)
        table.append(([p[:2] for p in queue.pulls[before:] if not p[2]], sorted(loop.active)))
    assert table == [
        ([(2, 100)], ["r0", "r1"]),  # idle: the pull may wait idle_block_ms
        ([(2, None)], ["r0", "r1", "r2", "r3"]),  # busy: it must not wait
        ([(1, None)], ["r0", "r1", "r2", "r3", "r4"]),  # room for one more
        ([], ["r0", "r1", "r2", "r3", "r4"]),  # full: no pull at all
        ([], ["r0", "r1", "r2", "r3", "r4"]),
    ]
    assert queue.running == ["r0", "r1", "r2", "r3", "r4"]
    assert [p.entry_id for p in queue.waiting] == ["e5", "e6", "e7"]


def test_admission_fails_what_cannot_run():
    loop, queue, backend, _ = make_loop()
    malformed = PulledRequest("e9", None, [])
    named = PulledRequest("e8", None, [], raw={"id": "r8", "payload": "[]"})  # its client hears
    queue.waiting = [malformed, named, pulled(1, prompt=[])]
    turn(loop)
    turn(loop)  # pull_per_turn (2) leaves the third for the next turn
    assert [(f.request_id, f.entry_id, f.error.message, f.error.type) for f in queue.failures] == [
        (None, "e9", "malformed request", "invalid_request_error"),
        ("r8", "e8", "malformed request", "invalid_request_error"),
        ("r1", "e1", "invalid request: the prompt is empty", "invalid_request_error"),
    ]
    assert loop.active == {} and backend.requests == {} and queue.running == []


# ---- cancels -----------------------------------------------------------------------------
def test_a_cancel_ends_its_request_and_leaves_the_others():
    loop, queue, backend, clock = make_loop()
    queue.waiting = [pulled(1), pulled(2), pulled(3, cancelled=True)]
    turn(loop)
    turn(loop)
    # Cancelled before it was pulled: never admitted, failed with "cancelled".
    assert queue.failure("r3").error == EngineError("cancelled", "cancelled", "cancelled")
    assert "r3" not in backend.requests
    queue.cancels = ["r1", "unknown"]
    turn(loop)
    turn(loop)
    assert sorted(loop.active) == ["r2"]
    assert [(m.index, m.tokens, m.finish_reason, m.error) for m in queue.messages("r1")] == [
        (0, [token("r1", 0)], None, None),
        (1, [token("r1", 1)], None, None),
        (2, [], "abort", None),
    ]
    assert len(queue.messages("r2")) == 4
    assert queue.acked == ["e3", "e1"]


# ---- deadlines ---------------------------------------------------------------------------
def test_a_request_past_its_deadline_is_not_admitted():
    loop, queue, backend, clock = make_loop()
    queue.waiting = [pulled(1, deadline=T0 - 0.1), pulled(2, deadline=T0 + 60)]
    turn(loop)
    failure = queue.failure("r1")
    assert (failure.entry_id, failure.error.type, failure.error.code) == (
        "e1",
        "timeout",
        "deadline_exceeded",
    )
    assert list(backend.requests) == ["r2"] and queue.running == ["r2"]


def test_a_running_request_is_aborted_once_its_deadline_passes():
    loop, queue, backend, clock = make_loop()
    queue.waiting = [pulled(1, deadline=T0 + 1.0), pulled(2)]
    table = []
    for at in (0.0, 0.6, 1.05, 1.2, 1.5):
        clock.now = T0 + at
        turn(loop)
        last = queue.messages("r1")[-1]
        table.append((at, "r1" in loop.active, last.finish_reason, last.error and last.error.code))
    assert table == [
        (0.0, True, None, None),
        (0.6, True, None, None),
        (1.05, True, None, None),  # passed, but deadlines are checked every 0.5 s
        (1.2, False, "abort", "deadline_exceeded"),
        (1.5, False, "abort", "deadline_exceeded"),
    ]
    assert queue.messages("r1")[-1].error.type == "timeout"
    assert "r2" in loop.active and queue.acked == ["e1"]


# ---- dead letters ------------------------------------------------------------------------
def test_a_request_delivered_too_often_is_dead_lettered():
    loop, queue, backend, clock = make_loop(max_deliveries=3)
    queue.orphans = [pulled(1, deliveries=3), pulled(2, deliveries=4), pulled(3, deliveries=9)]
    turn(loop)
    assert queue.claims == 1
    assert queue.dead == [
        ("e2", "delivered 4 times without finishing"),
        ("e3", "delivered 9 times without finishing"),
    ]
    assert list(loop.active) == ["r1"] and list(backend.requests) == ["r1"]
    assert queue.running == ["r1"]


def test_a_hand_back_makes_the_next_turn_claim_at_once():
    loop, queue, backend, clock = make_loop()
    table = []
    for at, handed_back in ((0.0, set()), (0.1, set()), (0.2, {"w2"}), (0.3, set())):
        clock.now = T0 + at
        queue.handed_back |= handed_back
        turn(loop)
        table.append((at, queue.claims))
    # Without a hand-back the next claim waits heartbeat_ttl / 2 = 2.5 s.
    assert table == [(0.0, 1), (0.1, 1), (0.2, 2), (0.3, 2)]


# ---- batch emission ----------------------------------------------------------------------
def test_batch_requests_emit_every_16_tokens_and_interactive_ones_every_step():
    loop, queue, backend, clock = make_loop()
    queue.waiting = [pulled(1, 40, priority=PRIORITY_BATCH), pulled(2, 40)]
    for _ in range(45):
        turn(loop)
    batch = [(m.index, len(m.tokens), m.finish_reason) for m in queue.messages("r1")]
    assert BATCH_EMIT_EVERY == 16
    assert batch == [(0, 16, None), (16, 16, None), (32, 8, "length")]
    interactive = [(m.index, len(m.tokens)) for m in queue.messages("r2")]
    assert interactive == [(i, 1) for i in range(40)]
    for rid in ("r1", "r2"):
        tokens = [t for m in queue.messages(rid) for t in m.tokens]
        assert tokens == [token(rid, i) for i in range(40)]
        final = queue.messages(rid)[-1]
        assert final.worker == "w1"
        assert final.usage == {"prompt_tokens": 1, "completion_tokens": 40, "queue_time": 1.0}
    assert queue.acked == ["e1", "e2"] and loop.active == {}


# ---- failing steps -----------------------------------------------------------------------
def test_a_step_that_raises_fails_the_requests_it_held():
    loop, queue, backend, clock = make_loop()
    queue.waiting = [pulled(1), pulled(2)]
    turn(loop)
    backend.raise_on_step = RuntimeError("out of memory")
    turn(loop)
    for rid in ("r1", "r2"):
        final = queue.messages(rid)[-1]
        assert (final.index, final.finish_reason) == (1, "abort")
        assert final.error == EngineError(
            "the engine failed on this request: out of memory", "server_error", "engine_error"
        )
    assert loop.active == {} and backend.requests == {}
    assert sorted(queue.acked) == ["e1", "e2"]
    # The engine goes on with the next requests.
    queue.waiting = [pulled(3, 2)]
    turn(loop)
    turn(loop)
    assert [m.finish_reason for m in queue.messages("r3")] == [None, "length"]


# ---- outages -----------------------------------------------------------------------------
def test_a_transient_error_makes_the_loop_set_up_again_and_resend():
    loop, queue, backend, clock = make_loop()
    queue.waiting = [pulled(1), pulled(2)]
    table = []
    for outage in (None, "emit", None, "pull", "setup", None):
        queue.outage_in = outage
        error = loop.turn()
        indices = [m.index for m in queue.messages("r1")]
        table.append((outage, type(error).__name__, queue.setups, queue.closes, indices))
    assert table == [
        (None, "NoneType", 1, 0, [0]),
        ("emit", "Outage", 1, 1, [0]),  # step 1's tokens kept back
        (None, "NoneType", 2, 1, [0, 1, 2]),  # set up again; step 1 resent before step 2
        ("pull", "Outage", 2, 2, [0, 1, 2]),  # no step
        ("setup", "Outage", 2, 3, [0, 1, 2]),  # not set up: no step
        (None, "NoneType", 3, 3, [0, 1, 2, 3]),
    ]
    # Each setup asked for the requests this worker holds; they were running already.
    assert [p for p in queue.pulls if p[2]] == [(64, None, True)] * 3
    assert sorted(loop.active) == ["r1", "r2"] and queue.running == ["r1", "r2"]


# ---- shutdown ----------------------------------------------------------------------------
def test_a_stop_with_zero_grace_hands_the_unfinished_requests_back():
    loop, queue, backend, clock = make_loop()
    queue.waiting = [pulled(1), pulled(2), pulled(3, 2)]
    for _ in range(3):
        turn(loop)
    assert queue.acked == ["e3"] and queue.heartbeats
    loop.stop(grace_period=0)
    loop.run()  # already stopping: no turn, only the drain
    assert loop.stopped.is_set()
    assert sorted(queue.held) == ["e1", "e2"] and queue.acked == ["e3"]
    assert [m.finish_reason for m in queue.messages("r1")] == [None] * 3
    assert backend.requests == {}
    assert queue.heartbeat_removed and queue.handback_announced and queue.closes == 1


def test_a_stop_with_grace_finishes_what_fits_and_hands_nothing_back():
    loop, queue, backend, clock = make_loop()
    queue.waiting = [pulled(1, 5), pulled(2, 8)]
    turn(loop)
    loop.stop(grace_period=30)
    loop.run()
    assert [m.finish_reason for m in queue.messages("r2")] == [None] * 7 + ["length"]
    assert queue.held == {} and sorted(queue.acked) == ["e1", "e2"]
    assert queue.heartbeat_removed and not queue.handback_announced
