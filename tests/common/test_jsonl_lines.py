"""The streaming line reader: a JSONL file's lines, whatever pieces its bytes come in."""

from __future__ import annotations

import asyncio
import random

import pytest

from llmq.common.storage.jsonl_lines import InputLine, LineSplitter, iter_lines

pytestmark = pytest.mark.unit

TEXT = '\ufeff{"a": 1}\r\n\n  \n{"b": "\u00e9\u2028x"}\n{"c": 3}'
EXPECTED = [
    InputLine(1, '{"a": 1}'),
    InputLine(4, '{"b": "\u00e9\u2028x"}'),
    InputLine(5, '{"c": 3}'),
]


def read(pieces: list[bytes]) -> list[InputLine]:
    async def chunks():
        for p in pieces:
            yield p

    async def collect():
        return [line async for line in iter_lines(chunks())]

    return asyncio.run(collect())


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def test_lines_are_the_same_whatever_the_pieces():
    """Every way of cutting the bytes (through the BOM, a \\r\\n, a multi-byte character)
    gives the same numbered lines: blank lines count in the numbers but are not yielded, the
    BOM is no part of line 1, U+2028 inside a string does not end a line."""
    data = TEXT.encode()
    assert read([data]) == EXPECTED
    for cut in range(len(data) + 1):
        assert read(split_at(data, [cut])) == EXPECTED, cut
    rng = random.Random(7)
    for _ in range(200):
        cuts = rng.sample(range(len(data) + 1), rng.randint(1, 8))
        assert read(split_at(data, cuts)) == EXPECTED, cuts
    assert read([bytes([b]) for b in data]) == EXPECTED  # a byte at a time


def test_edge_files():
    assert read([]) == [] and read([b""]) == [] and read([b"\n\n"]) == []
    assert read([b"\xef\xbb"]) == [InputLine(1, "\ufffd")]  # a BOM's start alone is data
    assert read([b"x\n"]) == [InputLine(1, "x")]
    assert read([b"\xff\xfe{}\n"]) == [InputLine(1, "\ufffd\ufffd{}")]  # not UTF-8: replaced


def test_the_splitter_holds_only_the_line_being_read():
    splitter = LineSplitter()
    assert splitter.feed(b'{"x": "' + b"a" * 100) == []
    assert splitter.feed(b'"}\n{"y"') == [(1, b'{"x": "' + b"a" * 100 + b'"}')]
    assert splitter._partial == [b'{"y"']
    assert splitter.close() == [(2, b'{"y"')]
