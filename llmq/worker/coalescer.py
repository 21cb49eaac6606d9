"""Fewer, larger output messages under load: ``LLMQ_STREAM_INTERVAL_MS``.

A step's news for every request goes to Redis in one call whatever the batch; at small steps
(a fast GPU, a tiny model) the calls themselves add up. With an interval, a request's tokens
wait (merged into one message) until the interval has passed since the last send, as vLLM's
``--stream-interval`` and MAX's minimum chunk do; a first token, a final message and an error
go at once (and take everything waiting with them), so time to first token and the end of a
request are unchanged. What waits is not recorded either: a worker that dies loses it, and the
request's next owner generates it again, as it does any step that never reached Redis."""

from __future__ import annotations

from collections.abc import Callable

from llmq.common.protocol import OutputMessage
from llmq.common.transport import Emission


class Coalescer:
    def __init__(self, interval_s: float, clock: Callable[[], float]):
        self.interval_s = interval_s
        self.clock = clock
        self._waiting: dict[str, Emission] = {}
        self._last_send = 0.0

    def take(self, emissions: list[Emission]) -> list[Emission]:
        """What to send now: everything, once the interval has passed or when a message is
        urgent; else nothing (the tokens wait, merged per request)."""
        if self.interval_s <= 0 and not self._waiting:
            return emissions
        urgent = False
        for e in emissions:
            msg = e.message
            urgent = urgent or msg.done or msg.prompt_logprobs is not None
            urgent = urgent or (msg.index == 0 and bool(msg.tokens))
            held = self._waiting.get(e.request_id)
            self._waiting[e.request_id] = e if held is None else _merged(held, e)
        return self.flush() if urgent or self.due() else []

    def due(self) -> bool:
        return bool(self._waiting) and self.clock() - self._last_send >= self.interval_s

    def flush(self) -> list[Emission]:
        self._last_send = self.clock()
        out, self._waiting = list(self._waiting.values()), {}
        return out

    def drop(self, request_id: str) -> None:
        """A request that is no longer this worker's: what waits for it must not go out."""
        self._waiting.pop(request_id, None)


def _merged(first: Emission, then: Emission) -> Emission:
    a, b = first.message, then.message
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    message = OutputMessage(
        index=a.index,
        tokens=a.tokens + b.tokens,
        finish_reason=b.finish_reason,
        logprobs=logprobs,
        usage=b.usage,
        error=b.error,
        worker=b.worker,
        embeddings=b.embeddings,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )
    return Emission(first.request_id, then.entry_id, message, then.reply_to)
