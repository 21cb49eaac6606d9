"""Mending a request's record that Redis lost the tail of, from the tokens the worker holds."""

from __future__ import annotations

import logging

from llmq.common.protocol import EngineRequest, OutputMessage
from llmq.common.transport import Emission, Refusal
from llmq.worker.backends import Backend
from llmq.worker.engine_queue import EngineQueue

log = logging.getLogger(__name__)


def mend_record(
    transport: EngineQueue, backend: Backend, r: Refusal, request: EngineRequest | None
) -> bool:
    """Write a running request's record again from where Redis lost it (a restart without
    persistence, an AOF that lost its tail), and the refused message with it: this worker
    holds every token it generated, so the record ends up what its client saw. Not for
    logprobs (only the latest are held) nor a request already finished here (``request``
    None: not running here)."""
    msg = r.message
    if msg is None or msg.logprobs or msg.done or request is None or r.recorded is None:
        return False
    tokens = backend.output_tokens(r.request_id)
    end = msg.index + len(msg.tokens)
    if tokens is None or len(tokens) < end:
        return False
    mended = OutputMessage(index=r.recorded, tokens=tokens[r.recorded : end])
    if transport.emit([Emission(r.request_id, r.entry_id, mended, request.reply_to)]):
        return False
    log.warning(
        "request %s: Redis lost %d of its recorded tokens; written again from this worker",
        r.request_id,
        msg.index - r.recorded,
    )
    return True
