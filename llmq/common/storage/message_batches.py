"""Anthropic's Message Batches as batches of the Batch API: a message batch is a batch on
``/v1/messages`` whose input file llmq writes from its ``requests`` (one line per
``{custom_id, params}``), run by the same runner (leases, checkpoints, each line answered
once), and shown in Anthropic's shape: its id (``msgbatch_`` and the batch's hex), its
``processing_status`` and ``request_counts``, and its results as JSONL, one line per
``custom_id`` (``succeeded``, ``errored``, ``canceled`` or ``expired``) from the batch's
output and error files."""

from __future__ import annotations

import datetime
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# The metadata key that marks a batch as a message batch (its requests came as Anthropic's).
MARK = "llmq_message_batch"
ENDPOINT = "/v1/messages"
_ID = re.compile(r"msgbatch_([0-9a-f]{32})")
_PROCESSING = {
    "canceling": ("cancelling",),
    "ended": ("completed", "failed", "cancelled", "expired"),
}
_ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
}


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    custom_id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict[str, Any]


class MessageBatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: list[BatchRequest] = Field(min_length=1, max_length=100_000)

    def input_file(self) -> bytes:
        """The Batch API input file of these requests; a duplicate custom_id is a ValueError."""
        ids = [r.custom_id for r in self.requests]
        if len(set(ids)) < len(ids):
            raise ValueError("custom_id values must be unique within a batch")
        lines = (
            {"custom_id": r.custom_id, "method": "POST", "url": ENDPOINT, "body": r.params}
            for r in self.requests
        )
        return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def batch_id_of(message_batch_id: str) -> str | None:
    """The Batch API id behind a message batch id (None for an id of another form)."""
    match = _ID.fullmatch(message_batch_id)
    return None if match is None else f"batch-{match.group(1)}"


def message_batch_id(batch_id: str) -> str:
    return "msgbatch_" + batch_id.removeprefix("batch-")


def is_message_batch(batch: dict[str, Any]) -> bool:
    return batch["endpoint"] == ENDPOINT and MARK in (batch.get("metadata") or {})


def _time(seconds: int | None) -> str | None:
    if seconds is None:
        return None
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return moment.isoformat().replace("+00:00", "Z")


def processing_status(status: str) -> str:
    for name, statuses in _PROCESSING.items():
        if status in statuses:
            return name
    return "in_progress"


def message_batch(batch: dict[str, Any], counts: dict[str, int], base_url: str) -> dict:
    """The batch as Anthropic's object; ``counts``: the ended batch's results by type."""
    status = processing_status(batch["status"])
    ended = next(
        (batch[f] for f in ("completed_at", "failed_at", "cancelled_at", "expired_at") if batch[f]),
        None,
    )
    seen = batch["request_counts"]
    processing = 0 if status == "ended" else seen["total"] - seen["completed"] - seen["failed"]
    ident = message_batch_id(batch["id"])
    return {
        "id": ident,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {
            "processing": max(processing, 0),
            "succeeded": counts.get("succeeded", seen["completed"]),
            "errored": counts.get("errored", seen["failed"]),
            "canceled": counts.get("canceled", 0),
            "expired": counts.get("expired", 0),
        },
        "ended_at": _time(ended) if status == "ended" else None,
        "created_at": _time(batch["created_at"]),
        "expires_at": _time(batch["expires_at"]),
        "archived_at": None,
        "cancel_initiated_at": _time(batch["cancelling_at"]),
        "results_url": f"{base_url}/v1/messages/batches/{ident}/results"
        if status == "ended"
        else None,
    }


def _error(body: dict[str, Any] | None, fallback: str) -> dict[str, Any]:
    """An answer's error as Anthropic's ``{"type": "error", "error": {type, message}}``."""
    inner = (body or {}).get("error") or {}
    kind = inner.get("type") if inner.get("type") in _ERROR_TYPES else "api_error"
    return {"type": "error", "error": {"type": kind, "message": inner.get("message") or fallback}}


def result_line(row: dict[str, Any]) -> dict[str, Any]:
    """One row of the batch's output or error file as Anthropic's result line."""
    response, error = row.get("response"), row.get("error") or {}
    if response is not None and response.get("status_code") == 200:
        result: dict[str, Any] = {"type": "succeeded", "message": response["body"]}
    elif response is not None:
        result = {"type": "errored", "error": _error(response.get("body"), "request failed")}
    elif error.get("code") == "batch_cancelled":
        result = {"type": "canceled"}
    elif error.get("code") == "batch_expired":
        result = {"type": "expired"}
    else:
        body = {"error": {"type": "api_error", "message": error.get("message")}}
        result = {"type": "errored", "error": _error(body, "no result")}
    return {"custom_id": row["custom_id"], "result": result}
