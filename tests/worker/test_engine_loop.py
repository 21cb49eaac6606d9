"""The engine loop turn by turn, on an in-memory queue and a scripted backend (no Redis, no
torch): admission, cancels, deadlines, dead letters, batch emission, outages and the hand-back
at shutdown (test_engine_loop_faults.py: failing steps, fenced requests, lost records)."""

from __future__ import annotations

import pytest

from llmq.common.protocol import PRIORITY_BATCH, EngineError
from llmq.common.transport import PulledRequest
from llmq.worker.engine_loop import BATCH_EMIT_EVERY
from tests.worker.engine_loop_fakes import (
    T0,
    ScriptedBackend,
    make_loop,
    pulled,
    token,
    turn,
)

pytestmark = pytest.mark.unit


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


def test_an_engine_with_no_live_peer_pulls_all_it_has_room_for():
    """Nobody to split a burst with: one pull takes what fits; with a peer (or none counted
    yet) pull_per_turn holds."""
    loop, queue, backend, _ = make_loop(ScriptedBackend(max_batch_size=16, capacity=5))
    queue.waiting = [pulled(i) for i in range(8)]
    turn(loop)  # not counted yet: pull_per_turn
    queue.live_peers = 0
    turn(loop)
    assert [p[:2] for p in queue.pulls if not p[2]] == [(2, 100), (3, None)]
    assert sorted(loop.active) == ["r0", "r1", "r2", "r3", "r4"]
    loop2, queue2, _, _ = make_loop(ScriptedBackend(max_batch_size=16, capacity=5))
    queue2.live_peers = 1
    queue2.waiting = [pulled(i) for i in range(8)]
    turn(loop2)
    assert [p[:2] for p in queue2.pulls if not p[2]] == [(2, 100)]


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


# ---- coalescing (LLMQ_STREAM_INTERVAL_MS) ------------------------------------------------
def test_an_interval_merges_tokens_but_sends_first_tokens_and_ends_at_once():
    loop, queue, _, clock = make_loop(stream_interval_s=0.05)
    queue.waiting = [pulled(1, max_tokens=9)]
    sent = []  # (turn, index, tokens, final) of every message, as it leaves the loop
    for t in range(10):
        before = len(queue.emitted)
        turn(loop)
        clock.now += 0.02  # a step of 20 ms: a message at most every third step
        for e in queue.emitted[before:]:
            m = e.message
            sent.append((t, m.index, [x % 1000 for x in m.tokens], m.finish_reason))
    assert sent == [
        (0, 0, [0], None),  # the first token at once
        (3, 1, [1, 2, 3], None),  # then what 60 ms gathered, merged
        (6, 4, [4, 5, 6], None),
        (8, 7, [7, 8], "length"),  # the end at once, with what waited
    ]
    assert queue.records["r1"] == [token("r1", i) for i in range(9)]


def test_no_interval_sends_every_step():
    loop, queue, _, _ = make_loop()
    queue.waiting = [pulled(1, max_tokens=3)]
    for _ in range(5):
        turn(loop)
    messages = queue.messages("r1")
    assert [(m.index, len(m.tokens), m.finish_reason) for m in messages] == [
        (0, 1, None),
        (1, 1, None),
        (2, 1, "length"),
    ]
