"""EngineStatus: the heartbeat hash as redis-cli shows it, and back."""

from __future__ import annotations

import pytest

from llmq.common.engine_status import EngineStatus

pytestmark = pytest.mark.unit


def test_round_trip_through_the_hash_redis_returns():
    status = EngineStatus(
        model="m",
        source="/models/m",
        max_model_len=2048,
        vocab_size=49152,
        pid=42,
        started=1700000000.5,
        random_weights=True,
        kv_blocks_total=100,
        kv_blocks_used=7,
        tokens_per_s=12.5,
        worker="w1",
    )
    fields = status.to_redis()
    assert "worker" not in fields  # the key names the worker
    assert fields["random_weights"] == 1 and fields["matryoshka"] == 0  # booleans as 0/1
    as_redis = {k.encode(): str(v).encode() for k, v in fields.items()}  # HGETALL: all bytes
    assert EngineStatus.from_redis(as_redis, "w1") == status


def test_missing_and_unreadable_fields_keep_their_defaults():
    """A worker of another version may lack a field or write one this one cannot read."""
    status = EngineStatus.from_redis(
        {"model": "m", "running": "3", "waiting": "", "kv_blocks_used": "x", "extra": "1"}
    )
    assert (status.model, status.running, status.waiting, status.kv_blocks_used) == ("m", 3, 0, 0)
    assert status.kind == "generate" and status.worker == ""


def test_a_model_named_like_a_number_stays_text():
    assert EngineStatus.from_redis({"model": "7", "random_weights": "true"}).model == "7"
    assert EngineStatus.from_redis({"random_weights": "true"}).random_weights is True
