"""After an engine step raised: find the request at fault instead of failing them all.

Every request of the step is taken out of the engine with the tokens it has so far; each is
then put back alone and stepped until it has news. The one whose step raises again is at fault
and stays out; the others go back in with the tokens they gained, exactly where they were
(resuming a request from its tokens is exact: the same mechanism resumes a request on another
worker, and a seeded sample depends only on the seed and the token's position).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from llmq.common.protocol import EngineRequest, OutputMessage
from llmq.worker.backends import Backend

log = logging.getLogger(__name__)

# Steps a request alone may take before it has news (a long prompt prefilled in chunks, a
# grammar still being built); past them it counts as sound and goes back in.
MAX_PROBE_STEPS = 64


@dataclass(slots=True)
class Isolated:
    news: list[tuple[str, OutputMessage]] = field(default_factory=list)
    failed: dict[str, tuple[int, Exception]] = field(default_factory=dict)  # id -> (index, why)


def step_one_by_one(backend: Backend, requests: dict[str, EngineRequest]) -> Isolated:
    """Step each of ``requests`` alone (see the module's docstring); their news, and the ones
    at fault with the number of tokens they had."""
    taken = {rid: backend.take(rid) for rid in requests}
    result = Isolated()
    sound: dict[str, list[int]] = {}
    for rid, tokens in taken.items():
        if tokens is None:  # the engine did not hold it
            continue
        try:
            backend.add(requests[rid], tokens)
            news = _step_alone(backend, rid)
        except Exception as exc:
            backend.abort(rid)
            log.error("request %s fails the engine's step on its own: %r", rid, exc)
            result.failed[rid] = (len(tokens), exc)
            continue
        result.news.extend(news)
        if not any(msg.done for _, msg in news):
            sound[rid] = backend.take(rid) or []  # out again: the next one is stepped alone
    for rid, tokens in sound.items():
        try:
            backend.add(requests[rid], tokens)
        except Exception as exc:  # it cannot go on from there (it never could)
            result.failed[rid] = (len(tokens), exc)
    return result


def _step_alone(backend: Backend, request_id: str) -> list[tuple[str, OutputMessage]]:
    for _ in range(MAX_PROBE_STEPS):
        news = backend.step()
        if news or not backend.has_unfinished():
            return news
    return []
