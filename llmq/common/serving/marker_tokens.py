"""Tool-call markers that are special tokens (Mistral's [TOOL_CALLS], Llama 3's <|python_tag|>)
are dropped when output is detokenized; MarkerKeepingStream puts them back into the text, where
their token stands, so that the tool-call parser sees them."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from llmq.common.engine_client.request_stream import GenerationChunk, RequestStream
from llmq.common.errors import LLMQError


def skipped_markers(tokenizer, markers: tuple[str, ...]) -> dict[int, str]:
    """The markers that are one token which detokenizing skips, by token id."""
    found: dict[int, str] = {}
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) != 1:
            continue
        shown = tokenizer.decode(ids, skip_special_tokens=False)
        if shown == marker and tokenizer.decode(ids, skip_special_tokens=True) == "":
            found[ids[0]] = marker
    return found


class MarkerKeepingStream:
    """A RequestStream whose chunks' text has the markers' tokens back in it."""

    def __init__(self, stream: RequestStream, tokenizer, markers: dict[int, str]):
        self.stream = stream
        self.tokenizer = tokenizer
        self.markers = markers

    @property
    def id(self) -> str:
        return self.stream.id

    def __aiter__(self) -> AsyncIterator[GenerationChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[GenerationChunk]:
        async for chunk in self.stream:
            yield self._restored(chunk)

    def fail(self, error: LLMQError) -> None:
        self.stream.fail(error)

    async def aclose(self) -> None:
        await self.stream.aclose()

    def _restored(self, chunk: GenerationChunk) -> GenerationChunk:
        ids = chunk.token_ids
        at = [k for k, t in enumerate(ids) if t in self.markers]
        if not at:
            return chunk
        text, pieces, start = chunk.text, [], 0
        for k in at:
            # The text after the marker's token is its last characters (the detokenizer may
            # hold back an incomplete character: it is not in this chunk's text).
            after = self.tokenizer.decode(ids[k + 1 :], skip_special_tokens=True).rstrip("\ufffd")
            cut = len(text) - len(after)
            if cut < start:
                continue  # in text a stop string cut off
            pieces += [text[start:cut], self.markers[ids[k]]]
            start = cut
        pieces.append(text[start:])
        return dataclasses.replace(chunk, text="".join(pieces))
