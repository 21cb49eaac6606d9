"""The rows of a batch's output and error files, in OpenAI's shape."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from llmq.common.storage.jsonl_lines import InputLine
from llmq.worker.batch.input_lines import custom_id_of


@dataclass(frozen=True, slots=True)
class LineResponse:
    status_code: int
    request_id: str
    body: dict


@dataclass(frozen=True, slots=True)
class RowError:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class ResultRow:
    """One line of the output or error file, in OpenAI's shape."""

    custom_id: object
    response: LineResponse | None
    error: RowError | None = None
    id: str = ""

    def to_dict(self) -> dict:
        response = self.response
        error = self.error
        return {
            "id": self.id or f"batch_req_{uuid.uuid4().hex}",
            "custom_id": self.custom_id,
            "response": None
            if response is None
            else {
                "status_code": response.status_code,
                "request_id": response.request_id,
                "body": response.body,
            },
            "error": None if error is None else {"code": error.code, "message": error.message},
        }


def unrun_row(line: InputLine, final: str) -> ResultRow:
    """The error-file row of a line with no result: no response, OpenAI's error code for a
    batch cancelled or expired before the line ran; in a batch that completed (a run stopped
    between the line's answer and its record, and no later run took the line) ``no_result``."""
    if final in ("cancelled", "expired"):
        why = "cancelled" if final == "cancelled" else "past its completion window"
        error = RowError(f"batch_{final}", f"the batch was {why} before this request ran")
    else:
        error = RowError("no_result", "this request has no recorded result; send it again")
    return ResultRow(custom_id_of(line.text), None, error)


def is_output_row(row: bytes) -> bool:
    """Whether a recorded row belongs in the output file (its request answered 200)."""
    response = json.loads(row).get("response")
    return response is not None and response.get("status_code") == 200
