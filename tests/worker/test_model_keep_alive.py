"""When a model loaded on demand is unloaded for its keep-alive or put to sleep (no Redis, no
model)."""

from __future__ import annotations

import pytest

from llmq.common.catalogue import Entry
from llmq.worker.model_manager import FIRST_REQUEST_S, Held, ModelManager, verdict

pytestmark = pytest.mark.unit


def held(loaded_at: float, served: bool, last_busy: float | None = None) -> Held:
    entry = Entry("beta", "/models/beta", 1 << 20)
    busy = loaded_at if last_busy is None else last_busy
    return Held(entry, None, None, loaded_at=loaded_at, last_busy=busy, served=served)


def test_a_model_waits_for_the_request_that_asked_for_it():
    """With keep_alive 0 a model loaded a moment ago is kept until a request reached it (the API
    queues the waiting one once it sees the model up), or until FIRST_REQUEST_S has passed."""
    assert not ModelManager._had_its_turn(held(100.0, served=False), 100.5)
    assert ModelManager._had_its_turn(held(100.0, served=True), 100.5)
    assert ModelManager._had_its_turn(held(100.0, served=False), 100.0 + FIRST_REQUEST_S)


def test_unload_keep_alive_sleep_and_idle_sleep_in_that_order():
    served = held(100.0, served=True, last_busy=200.0)
    never = (0.0, 0.0)
    assert verdict(served, 205.0, 300.0, never, 0.0) is None
    assert verdict(served, 205.0, 300.0, never, 5.0) == (
        "idle for 5 s (LLMQ_SLEEP_IDLE_SECONDS)",
        True,
    )
    assert verdict(served, 205.0, 3.0, never, 5.0) == ("idle past its keep-alive of 3 s", False)
    assert verdict(served, 201.0, 300.0, (0.0, 150.0), 0.0) == ("a sleep was asked for", True)
    assert verdict(served, 201.0, 300.0, (150.0, 150.0), 0.0) == ("an unload was asked for", False)
    # Asked for before this load: the load answered a later request, and stays.
    assert verdict(served, 201.0, 300.0, (50.0, 50.0), 0.0) is None
    # Kept for good (-1), and never slept while its first request has not reached it.
    assert verdict(served, 9999.0, -1.0, never, 0.0) is None
    assert verdict(held(100.0, served=False), 105.0, 300.0, never, 1.0) is None
