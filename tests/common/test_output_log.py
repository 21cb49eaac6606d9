"""A request's output record (common/transport/output_log.py): the compact values a worker's
log holds, the frames an API process receives, and the merge of a list with its log tail."""

from __future__ import annotations

import pytest

from llmq.common.protocol import EngineError, OutputMessage
from llmq.common.transport.output_log import (
    Tail,
    decode_frame,
    decode_value,
    encode_frame,
    encode_logprobs,
    encode_value,
    frame_value,
    merge,
)

pytestmark = pytest.mark.unit

LP = '{"token_id":7,"logprob":-0.5,"top":[[7,-0.5]]}'


def test_values_round_trip_with_and_without_logprobs():
    assert decode_value(encode_value(3, [7, 8], None)) == (3, [7, 8], None)
    assert decode_value(encode_value(0, [], None)) == (0, [], None)
    lp = {"token_id": 7, "logprob": -0.5, "top": [[7, -0.5]]}
    assert decode_value(encode_value(5, [7], [LP])) == (5, [7], [lp])


def test_a_frame_carries_plain_messages_compact_and_the_others_whole():
    final = OutputMessage(9, [4], finish_reason="length", usage={"completion_tokens": 10})
    error = OutputMessage(2, error=EngineError("boom", "server_error", "engine_error"))
    plain = OutputMessage(8, [1, 2], logprobs=[{"token_id": 1}, {"token_id": 2}])
    messages = [("a", plain), ("b", final), ("c", error)]
    frame = encode_frame([(key, frame_value(m, encode_logprobs(m))) for key, m in messages])
    assert "\x1ea\x1f8|1,2|" in frame and '\x1eb\x1f{"index":9' in frame
    assert decode_frame(frame.encode()) == {"a": plain, "b": final, "c": error}


def test_a_tail_takes_messages_sent_again_without_repeating_them():
    tail = Tail(first=4)
    tail.add(4, [10, 11], None)
    tail.add(6, [12], None)
    tail.add(5, [11, 12, 13], None)  # sent again after an outage, one more token
    tail.add(2, [8, 9, 10], None)  # before ``first``: in the list already
    assert (tail.first, tail.tokens, tail.end) == (4, [10, 11, 12, 13], 8)
    tail.add(9, [99], None)  # past a hole: nothing lands out of place
    assert tail.tokens == [10, 11, 12, 13]
    tail.moved()
    assert (tail.first, tail.tokens) == (8, [])


def test_a_tail_keeps_logprobs_beside_its_tokens():
    tail = Tail(first=0)
    tail.add(0, [1, 2], ["a", "b"])
    tail.add(1, [2, 3], ["b", "c"])
    assert (tail.tokens, tail.logprobs) == ([1, 2, 3], ["a", "b", "c"])


def test_merge_reads_values_in_order_dropping_overlaps_and_stopping_at_a_hole():
    values = [encode_value(0, [1, 2], None), encode_value(2, [3], None)]
    values += [encode_value(3, [4, 5], None), encode_value(1, [2], None)]
    assert merge(values) == ([1, 2, 3, 4, 5], None)
    assert merge([encode_value(0, [1], None), encode_value(3, [4], None)]) == ([1], None)
    lps = [encode_value(0, [1], ['{"token_id":1}']), encode_value(1, [2], ['{"token_id":2}'])]
    assert merge(lps, logprobs=True) == ([1, 2], [{"token_id": 1}, {"token_id": 2}])
    with pytest.raises(ValueError):
        merge(["x"])  # a record written by hand: its request fails alone
