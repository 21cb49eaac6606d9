"""A JSONL file's lines as its bytes arrive, in pieces of any size: the API counts an upload's
lines with it while the upload streams in, a batch run reads its input file with it chunk by
chunk, and neither ever holds the whole file."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import NamedTuple

BOM = b"\xef\xbb\xbf"


class InputLine(NamedTuple):
    number: int  # 1-based, counting empty lines too
    text: str


class LineSplitter:
    """Splits bytes fed in any pieces into the non-blank lines they complete, numbered from 1
    (blank lines count in the numbers). Lines end at ``\\n`` (a ``\\r`` before it is dropped);
    a UTF-8 byte order mark is no part of line 1. Only the line being read is held."""

    def __init__(self) -> None:
        self._partial: list[bytes] = []
        self._number = 0
        self._started = False

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The lines ``data`` completes, as (number, bytes without the line end)."""
        if not self._started:
            data = b"".join([*self._partial, data])
            self._partial = []
            if len(data) < len(BOM) and BOM.startswith(data):
                self._partial.append(data)  # too short to tell a BOM yet
                return []
            self._started = True
            data = data.removeprefix(BOM)
        if b"\n" not in data:
            if data:
                self._partial.append(data)
            return []
        pieces = data.split(b"\n")
        pieces[0] = b"".join([*self._partial, pieces[0]])
        last = pieces.pop()
        self._partial = [last] if last else []
        return [line for piece in pieces if (line := self._line(piece)) is not None]

    def close(self) -> list[tuple[int, bytes]]:
        """The last line, when the data does not end with a line end."""
        rest = b"".join(self._partial)
        self._partial = []
        if not self._started:
            rest = rest.removeprefix(BOM)
        line = self._line(rest) if rest else None
        return [line] if line is not None else []

    def _line(self, piece: bytes) -> tuple[int, bytes] | None:
        self._number += 1
        piece = piece.removesuffix(b"\r")
        return (self._number, piece) if piece.strip() else None


def decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


async def iter_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[InputLine]:
    """The non-blank lines of the content ``chunks`` yields, decoded (UTF-8; bytes that are
    not UTF-8 replaced, so such a line fails alone when parsed)."""
    splitter = LineSplitter()
    async for chunk in chunks:
        for number, raw in splitter.feed(chunk):
            yield InputLine(number, decode(raw))
    for number, raw in splitter.close():
        yield InputLine(number, decode(raw))
