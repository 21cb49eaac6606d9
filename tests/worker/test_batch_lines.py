"""A batch line's way to its answer, with in-memory fakes of the seams (the answering service,
the results store): the API's body limit, the line's ids and priority, the rows recorded."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmq.common.protocol import PRIORITY_BATCH
from llmq.common.serving import SubmitOptions
from llmq.common.storage.jsonl_lines import InputLine
from llmq.worker.batch.executor import ServiceExecutor, encoded_size
from llmq.worker.batch.lines import LineRunner, RetryPolicy
from llmq.worker.batch.retry import Backoff

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


class FakeService:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, SubmitOptions]] = []

    async def answer(self, endpoint: str, body: dict, options: SubmitOptions):
        self.calls.append((endpoint, body, options))
        return 200, {"object": "chat.completion", "id": options.request_id(0)}


class Rows:
    """The checkpoint (``LineCheckpoint``), in memory."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[dict, bool]] = {}
        self.attempts: dict[int, int] = {}

    async def record(self, line: int, output: dict, ok: bool) -> bool:
        self.rows[line] = (output, ok)
        return True

    async def set_attempt(self, line: int, attempt: int) -> None:
        self.attempts[line] = attempt


NO_RETRY = RetryPolicy(Backoff(0.01, 0.01), deadline=float("inf"))


def body_of_size(size: int) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": ""}], "stream": False}
    body["messages"][0]["content"] = "x" * (size - encoded_size(body))
    assert encoded_size(body) == size
    return body


def test_a_body_over_the_api_limit_is_answered_413_without_running():
    service = FakeService()
    executor = ServiceExecutor(service, max_body_bytes=1000)
    status, body = asyncio.run(executor.answer(CHAT, body_of_size(1001), "batch_x-3"))
    assert status == 413
    assert body == {
        "error": {
            "message": "the request body is over the limit of 1000 bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
    }
    assert service.calls == []
    # At the limit it runs, at batch priority, with the line's ids.
    status, body = asyncio.run(executor.answer(CHAT, body_of_size(1000), "batch_x-3"))
    assert (status, body["id"]) == (200, "batch_x-3-0")
    [(endpoint, _, options)] = service.calls
    assert endpoint == CHAT
    assert options == SubmitOptions(priority=PRIORITY_BATCH, request_id_prefix="batch_x-3")


def test_every_line_is_recorded_with_its_status_and_request_id():
    service = FakeService()
    rows = Rows()
    runner = LineRunner(rows, "batch_x", CHAT, ServiceExecutor(service, 10_000), NO_RETRY)
    good = {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"model": "m"}}
    lone_surrogate = {**good, "custom_id": "b", "body": {"model": "\ud800"}}
    lines = [
        InputLine(1, json.dumps(good)),
        InputLine(2, json.dumps(lone_surrogate)),
        InputLine(4, json.dumps({**good, "custom_id": 7})),
    ]

    async def run() -> None:
        await asyncio.gather(*(runner.run(line) for line in lines))

    asyncio.run(run())
    assert sorted(rows.rows) == [1, 2, 4]
    ok, passed = rows.rows[1]
    assert passed and ok["custom_id"] == "a" and ok["error"] is None
    assert ok["id"].startswith("batch_req_")
    assert ok["response"] == {
        "status_code": 200,
        "request_id": "batch_x-1",
        "body": {"object": "chat.completion", "id": "batch_x-1-0"},
    }
    assert service.calls[0][1] == {"model": "m", "stream": False}
    unicode, passed = rows.rows[2]
    assert not passed and unicode["response"]["status_code"] == 400
    error = unicode["response"]["body"]["error"]
    assert error["message"] == "line 2: the body is not valid Unicode text"
    assert error["code"] == "invalid_line"
    refused, passed = rows.rows[4]
    assert not passed and refused["custom_id"] == 7
    assert refused["response"]["body"]["error"]["message"] == "line 4: custom_id must be a string"
    assert len(service.calls) == 1


def test_lines_python_reads_but_json_does_not_fail_alone_with_a_400():
    """NaN and Infinity (Python's json takes them; no answer could carry them) and nesting too
    deep to parse: that line's 400, not a 500 or a task that dies on the whole file."""
    from llmq.worker.batch.input_lines import LineRefused, custom_id_of, parse_line

    deep = '{"custom_id": "d", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    nan = {"custom_id": "n", "url": CHAT, "body": {"temperature": float("nan")}}
    inf = {"custom_id": "i", "url": CHAT, "body": {"top_p": float("-inf")}}
    lines = {json.dumps(nan): "NaN", json.dumps(inf): "-Infinity", deep: "nested too deeply"}
    for n, (text, why) in enumerate(lines.items(), 1):
        try:
            parse_line(InputLine(n, text), CHAT)
        except LineRefused as refused:
            assert refused.error.status == 400 and refused.error.code == "invalid_line"
            assert why in refused.error.message, refused.error.message
        else:
            raise AssertionError(f"line {n} was accepted")
        assert custom_id_of(text) is None  # the unrun row names no custom_id it cannot read
