"""One /api/chat or /api/generate request running as a chat or completion generation: answered
whole (``complete``) or as NDJSON lines (``stream``); a failure mid-stream ends it with an
``{"error": ...}`` line, as Ollama ends one."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from llmq.common.errors import LLMQError
from llmq.common.serving.ollama_api.chunks import OllamaLines
from llmq.common.serving.ollama_api.objects import Timings
from llmq.common.serving.responses import WireModel
from llmq.common.serving.run import Generation


class OllamaRun:
    def __init__(self, generation: Generation, lines: OllamaLines, timings: Timings):
        self.generation = generation
        self.lines = lines
        self.timings = timings

    def _ended(self) -> None:
        self.timings.ended = time.monotonic_ns()
        first = self.generation.choices[0].group.first_token_at  # time.monotonic()'s clock
        if first:
            self.timings.first_token = int(first * 1e9)

    async def complete(self) -> WireModel:
        answer = await self.generation.complete()
        self._ended()
        return self.lines.whole(answer)  # type: ignore[arg-type]

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async with contextlib.aclosing(self.generation.chunks()) as chunks:
                async for chunk in chunks:
                    for line in self.lines.feed(chunk):  # type: ignore[arg-type]
                        yield line.model_dump()
        except LLMQError as exc:
            yield self.lines.error(exc.message)
            return
        self._ended()
        for line in self.lines.finish():
            yield line.model_dump()

    def fail(self, error: LLMQError) -> None:
        self.generation.fail(error)

    async def aclose(self) -> None:
        await self.generation.aclose()
