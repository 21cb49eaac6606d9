"""Pipelines that carry scripts. redis-py refuses EVALSHA in a Redis Cluster's pipeline, so
there the calls run one after another (only rare paths pipeline scripts: a worker's first
writes, claims, taking its own requests back after a restart)."""

from __future__ import annotations

from typing import Any


class _OneByOne:
    def __init__(self, client: Any):
        self.client = client
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        def record(*args, **kwargs) -> None:
            self.calls.append((name, args, kwargs))

        return record

    def execute(self) -> list:
        calls, self.calls = self.calls, []
        return [getattr(self.client, name)(*args, **kwargs) for name, args, kwargs in calls]


def script_pipeline(client: Any):
    """A non-transactional pipeline of ``client``, or its stand-in on a Redis Cluster."""
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        return _OneByOne(client)
    return client.pipeline(transaction=False)
