"""The Redis transport: the only package that knows key names, stream fields and message
formats; everything else speaks the dataclasses of ``common/protocol.py``.

- ``keys``: every key name (listed in its docstring) and the Lua scripts
- ``engine``: the worker's side (``EngineTransport``, synchronous redis-py)
- ``client``: the API's and the batch tasks' side (``AsyncTransport``, redis.asyncio)
- ``redis_clients`` (with ``redis_cluster``, ``redis_sentinel``): the Redis connections every
  process opens; ``celery_client``: the Celery app that sends tasks by name;
  ``redis_server`` / ``embedded_redis``: a local redis-server for `llmq up` and the tests
"""

from llmq.common.transport.client import AsyncTransport
from llmq.common.transport.engine import (
    Emission,
    EngineTransport,
    PulledRequest,
    Refusal,
    ensure_group,
)
from llmq.common.transport.keys import GROUP, Keys

__all__ = [
    "GROUP",
    "AsyncTransport",
    "Emission",
    "EngineTransport",
    "Keys",
    "PulledRequest",
    "Refusal",
    "ensure_group",
]
