"""A model the worker will not serve: why, told where operators and clients look.

A worker that loads a model whose attention asks for something llmq does not implement
(``runner/forward/model_support.py``) never joins the model's stream, writes no heartbeat and exits
non-zero. Before it exits it logs the reason and records it with the model in the registry of
served models (``llmq:models``): the API then answers requests for that model with a 400
``model_not_supported`` naming the feature (while no live worker serves it), `llmq inspect`
lists it, and a worker that later serves the model replaces the record.
"""

from __future__ import annotations

import json
import logging

from llmq.common.settings import Settings
from llmq.common.transport.redis_clients import engine_client, keys_for

log = logging.getLogger(__name__)


def record_refusal(settings: Settings, model: str, worker: str, reason: str) -> None:
    """Record that ``worker`` refused ``model`` for ``reason`` (best effort: Redis may be away,
    and the worker exits with the reason in its log anyway)."""
    log.critical("refusing to serve %s: %s", model, reason)
    record = {"source": settings.model, "kind": "generate", "refused": reason, "worker": worker}
    try:
        client = engine_client(settings.redis_url_or_default(), settings.redis_sentinel_master)
        client.hset(keys_for(settings).models, model, json.dumps(record))
        client.close()
    except Exception as exc:  # the log line above still says why
        log.warning("the refusal of %s was not recorded in Redis: %s", model, exc)
