"""A request the engine loop serves, and how each step's news for it goes out."""

from __future__ import annotations

from dataclasses import dataclass

from llmq.common.protocol import PRIORITY_INTERACTIVE, EngineError, EngineRequest, OutputMessage
from llmq.common.transport import Emission

# Batch-job requests publish (and record) their tokens in groups: nobody watches them token by
# token, and every message costs the worker process Python time that interactive requests need.
BATCH_EMIT_EVERY = 16


@dataclass(slots=True)
class Active:
    request: EngineRequest
    request_id: str
    entry_id: str
    deadline: float | None
    created: float
    started: float
    priority: int = PRIORITY_INTERACTIVE
    held: OutputMessage | None = None  # batch-priority tokens not yet sent

    def emission(self, msg: OutputMessage, worker: str) -> Emission | None:
        """A step's news as it goes out (None: held back, a batch request's tokens until
        there are BATCH_EMIT_EVERY of them); a final message names ``worker``."""
        if self.priority > PRIORITY_INTERACTIVE and msg.error is None:
            if self.held is not None:
                held = self.held
                held.tokens = held.tokens + msg.tokens
                if held.logprobs is not None or msg.logprobs is not None:
                    held.logprobs = (held.logprobs or []) + (msg.logprobs or [])
                held.finish_reason, held.usage = msg.finish_reason, msg.usage
                msg = held
            if not msg.done and len(msg.tokens) < BATCH_EMIT_EVERY:
                self.held = msg
                return None
            self.held = None
        if msg.done:
            msg.worker = worker
            if msg.usage is not None and self.created:
                msg.usage["queue_time"] = round(max(0.0, self.started - self.created), 4)
        return Emission(self.request_id, self.entry_id, msg, self.request.reply_to)


def deadline_error() -> EngineError:
    return EngineError("the request passed its deadline", "timeout", "deadline_exceeded")
