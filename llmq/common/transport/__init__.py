"""The Redis transport: the only package that knows key names, stream fields and message
formats; everything else speaks the dataclasses of ``common/protocol.py``.

- ``keys``: every key name (listed in its docstring) and the Lua scripts
- ``engine``: the worker's side (``EngineTransport``, synchronous redis-py)
- ``client``: the API's and the batch tasks' side (``AsyncTransport``, redis.asyncio)
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
