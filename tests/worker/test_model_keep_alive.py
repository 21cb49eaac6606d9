"""When a model loaded on demand may be unloaded for its keep-alive (no Redis, no model)."""

from __future__ import annotations

import pytest

from llmq.common.catalogue import Entry
from llmq.worker.model_manager import FIRST_REQUEST_S, Held, ModelManager

pytestmark = pytest.mark.unit


def held(loaded_at: float, served: bool) -> Held:
    entry = Entry("beta", "/models/beta", 1 << 20)
    return Held(entry, loop=None, thread=None, loaded_at=loaded_at, served=served)


def test_a_model_waits_for_the_request_that_asked_for_it():
    """With keep_alive 0 a model loaded a moment ago is kept until a request reached it (the API
    queues the waiting one once it sees the model up), or until FIRST_REQUEST_S has passed."""
    assert not ModelManager._had_its_turn(held(100.0, served=False), 100.5)
    assert ModelManager._had_its_turn(held(100.0, served=True), 100.5)
    assert ModelManager._had_its_turn(held(100.0, served=False), 100.0 + FIRST_REQUEST_S)
