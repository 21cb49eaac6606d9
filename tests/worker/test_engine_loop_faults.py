"""The engine loop's faults, turn by turn on the in-memory queue and the scripted backend: a
step that raises (for everyone, or for one request), a request another worker took over, a
record that lost its tail, the heartbeat through a long step, and the loop's death."""

from __future__ import annotations

import logging
import threading

import pytest

from llmq.common.protocol import EngineError
from tests.harness import wait_for
from tests.worker.engine_loop_fakes import ScriptedBackend, make_loop, pulled, token, turn

pytestmark = pytest.mark.unit


def tokens_of(queue, rid: str) -> list[int]:
    return [t for m in queue.messages(rid) for t in m.tokens]


def test_a_step_that_raises_once_fails_nobody():
    loop, queue, backend, _ = make_loop()
    queue.waiting = [pulled(1, 5), pulled(2, 5)]
    turn(loop)
    backend.raise_on_step = RuntimeError("out of memory")
    for _ in range(6):
        turn(loop)
    for rid in ("r1", "r2"):
        assert tokens_of(queue, rid) == [token(rid, i) for i in range(5)]
        assert queue.messages(rid)[-1].finish_reason == "length"
    assert queue.failures == [] and loop.active == {} and sorted(queue.acked) == ["e1", "e2"]


def test_a_step_that_raises_for_one_request_fails_that_one_alone():
    loop, queue, backend, _ = make_loop()
    queue.waiting = [pulled(1, 6), pulled(2, 6)]
    turn(loop)
    queue.waiting = [pulled(3, 6)]
    turn(loop)  # r1, r2: 2 tokens; r3: 1
    backend.raise_for = {"r2"}
    for _ in range(8):
        turn(loop)
    for rid in ("r1", "r3"):  # token-exact across the probing
        assert tokens_of(queue, rid) == [token(rid, i) for i in range(6)]
        assert queue.messages(rid)[-1].finish_reason == "length"
    final = queue.messages("r2")[-1]
    assert (final.index, final.finish_reason) == (2, "abort")
    assert final.error == EngineError(
        "the engine failed on this request: bad values in r2", "server_error", "engine_error"
    )
    assert tokens_of(queue, "r2") == [token("r2", 0), token("r2", 1)]
    assert loop.active == {} and backend.requests == {}
    assert sorted(queue.acked) == ["e1", "e2", "e3"]


def test_a_request_claimed_by_another_worker_stops_here(caplog):
    loop, queue, backend, _ = make_loop()
    queue.waiting = [pulled(1), pulled(2)]
    turn(loop)
    turn(loop)
    queue.owners["r1"] = "w2"  # w1 froze past its heartbeat; w2 claimed r1
    with caplog.at_level(logging.WARNING):
        turn(loop)
        turn(loop)
    assert [m.index for m in queue.messages("r1")] == [0, 1]  # nothing after the claim
    assert list(loop.active) == ["r2"] and list(backend.requests) == ["r2"]
    assert "e1" not in queue.acked  # w2's entry now: not w1's to ack
    assert [m.index for m in queue.messages("r2")] == [0, 1, 2, 3]
    assert "request r1 was claimed by w2" in caplog.text


def test_a_request_claimed_before_it_was_admitted_is_not_run():
    loop, queue, backend, _ = make_loop()
    queue.waiting = [pulled(1), pulled(2)]
    queue.owners["r1"] = "w2"
    turn(loop)
    assert list(loop.active) == ["r2"] and list(backend.requests) == ["r2"]
    assert queue.running == ["r2"] and queue.messages("r1") == []


def test_a_record_that_lost_its_tail_is_written_again_from_the_worker(caplog):
    loop, queue, backend, _ = make_loop()
    queue.waiting = [pulled(1, 8), pulled(2, 8)]
    for _ in range(3):
        turn(loop)
    del queue.records["r1"][1:]  # Redis restarted from an AOF that lost the tail
    with caplog.at_level(logging.WARNING):
        for _ in range(6):
            turn(loop)
    for rid in ("r1", "r2"):
        assert queue.records[rid] == [token(rid, i) for i in range(8)]
        assert queue.messages(rid)[-1].finish_reason == "length"
    assert queue.failures == [] and loop.active == {}
    assert "Redis lost 2 of its recorded tokens" in caplog.text


def test_a_final_message_refused_for_a_lost_tail_fails_its_request_and_the_loop_goes_on(caplog):
    loop, queue, backend, _ = make_loop()
    queue.waiting = [pulled(1, 4), pulled(2, 8)]
    for _ in range(3):
        turn(loop)
    del queue.records["r1"][1:]  # lost just before r1's last token: nothing holds the rest
    with caplog.at_level(logging.ERROR):
        turn(loop)
    failure = queue.failure("r1")
    assert (failure.index, failure.error.type, failure.error.code) == (
        1,
        "server_error",
        "output_record_lost",
    )
    assert [m.index for m in queue.messages("r1")] == [0, 1, 2]  # nothing out of place
    assert "r1" not in loop.active and "r1" not in backend.requests
    queue.waiting = [pulled(3, 2)]
    for _ in range(6):
        turn(loop)
    for rid, n in (("r2", 8), ("r3", 2)):
        assert tokens_of(queue, rid) == [token(rid, i) for i in range(n)]
    assert "record in Redis holds 1 tokens" in caplog.text


class BlockingBackend(ScriptedBackend):
    """Its steps wait until ``release`` is set: one step as long as a test needs."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.in_step = threading.Event()

    def step(self):
        self.in_step.set()
        self.release.wait(30)
        return super().step()


def test_the_heartbeat_goes_on_through_a_long_step_and_ends_with_the_loop():
    backend = BlockingBackend()
    loop, queue, _, _ = make_loop(backend, heartbeat_ttl=0.3)
    queue.waiting = [pulled(1, 2)]
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    assert backend.in_step.wait(10)
    seen = len(queue.heartbeats)
    wait_for(lambda: len(queue.heartbeats) >= seen + 3, 10, "heartbeats during the step", 0.01)
    backend.release.set()
    loop.stop(grace_period=5)
    thread.join(10)
    assert loop.stopped.is_set() and queue.heartbeat_removed
    count = len(queue.heartbeats)
    assert not loop.heartbeat._thread  # stopped before the removal: none is written after it
    assert len(queue.heartbeats) == count


def test_a_hung_step_withholds_the_heartbeat_until_the_loop_turns_again(caplog):
    backend = BlockingBackend()
    loop, queue, _, _ = make_loop(backend, heartbeat_ttl=0.3, stall_timeout=0.5)
    queue.waiting = [pulled(1, 2)]
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    assert backend.in_step.wait(10)
    wait_for(lambda: loop.heartbeat._stalled, 10, "the stall to be noticed", 0.01)
    count = len(queue.heartbeats)
    # Three beat intervals with the step still hung: nothing written (an absence, so a wait).
    threading.Event().wait(3 * loop.heartbeat.interval)
    assert len(queue.heartbeats) == count
    assert "no progress" in caplog.text
    backend.release.set()
    wait_for(lambda: len(queue.heartbeats) > count, 10, "the heartbeat to resume", 0.01)
    loop.stop(grace_period=5)
    thread.join(10)
    assert loop.stopped.is_set()


def test_a_loop_that_dies_takes_its_heartbeat_with_it():
    loop, queue, _, _ = make_loop(heartbeat_ttl=0.3)
    queue.outage_in = "drain_cancels"
    queue.transient_errors = ()  # the error is not one the loop survives
    with pytest.raises(Exception, match="connection refused"):
        loop.run()
    assert queue.heartbeat_removed and loop.stopped.is_set()
    assert not loop.heartbeat._thread
