"""The engine loop's side of placement, on the in-memory queue and a scripted backend:
requests handed over to the worker taken as it has room, its cache's block hashes published
with its status, and the prompt tokens it served from cache and computed in its heartbeat."""

from __future__ import annotations

import pytest

from llmq.common.protocol import OutputMessage
from llmq.worker.cache_report import PLACEMENT_IDLE_BLOCK_MS
from tests.worker.engine_loop_fakes import ScriptedBackend, make_loop, pulled, turn

pytestmark = pytest.mark.unit


class CachingBackend(ScriptedBackend):
    """Holds a set of block hashes, reports each prompt as 2 tokens of 3 cached."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hashes = {11, 22}

    def cached_block_hashes(self) -> list[int]:
        return sorted(self.hashes)

    def step(self) -> list[tuple[str, OutputMessage]]:
        news = super().step()
        for _, msg in news:
            if msg.usage is not None:
                msg.usage.update(prompt_tokens=3, cached_tokens=2)
        return news


def test_requests_handed_over_are_taken_when_announced_and_as_room_allows():
    loop, queue, backend, _ = make_loop(ScriptedBackend(capacity=3), placement=True)
    queue.handed = [pulled(i, max_tokens=3) for i in range(5)]
    turn(loop)  # at start a worker looks in its pending list once
    assert sorted(loop.active) == ["r0", "r1", "r2"]
    assert queue.handover_waiting  # two left for when room frees
    assert queue.running == ["r0", "r1", "r2"]
    for _ in range(100):  # the first ones finish; the rest come in
        if not loop.active and not queue.handed:
            break
        turn(loop)
    assert not queue.handed and not loop.active
    assert sorted(queue.acked) == [f"e{i}" for i in range(5)]


def test_placement_off_never_looks_for_handed_requests():
    loop, queue, _, _ = make_loop(placement=False)
    queue.handed = [pulled(0)]
    turn(loop)
    assert queue.handed and not loop.active
    assert loop.idle_block_ms == 100


def test_an_idle_placing_worker_waits_briefly_on_the_stream():
    loop, queue, _, _ = make_loop(placement=True)
    turn(loop)
    assert queue.pulls[-1][1] == PLACEMENT_IDLE_BLOCK_MS


def test_the_heartbeat_counts_prompt_tokens_and_the_cache_is_published():
    backend = CachingBackend(max_batch_size=8)
    loop, queue, _, clock = make_loop(backend, placement=True)
    queue.waiting = [pulled(i, max_tokens=2) for i in range(4)]
    for _ in range(10):
        turn(loop)
        clock.now += 0.5
    assert not loop.active
    clock.now += 5
    turn(loop)
    loop.heartbeat.beat()
    beat = queue.heartbeats[-1]
    assert (beat.prompt_tokens_cached, beat.prompt_tokens_computed) == (8, 4)
    assert beat.placement
    assert queue.published[-1] == {11, 22}
    backend.hashes = {22, 33}  # one evicted, one cached
    clock.now += 5
    turn(loop)
    assert queue.published[-1] == {22, 33}
