"""The rows of a batch's output and error files, and the end of a batch: its files written
from the recorded lines, then its final state."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from llmq.common.store import Store
from llmq.worker.batch.input_lines import InputLine, custom_id_of


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
    """The error-file row of a line that never ran: no response, OpenAI's error code."""
    why = "cancelled" if final == "cancelled" else "past its completion window"
    error = RowError(f"batch_{final}", f"the batch was {why} before this request ran")
    return ResultRow(custom_id_of(line.text), None, error)


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()


async def finalize(
    store: Store,
    batch_id: str,
    final: str,
    allowed_from: tuple[str, ...],
    lines: list[InputLine] = (),
) -> str:
    """Write the batch's files (unless it failed validation) and move it to ``final``; returns
    the state it was moved to."""
    if final != "failed":
        moved = await store.transition(batch_id, "finalizing", ("in_progress",))
        # A cancel that landed after the last line: end the batch cancelled (with every
        # line), not stuck in "cancelling" until a re-dispatched task finalizes it again.
        if moved is None and final == "completed" and await store.status(batch_id) == "cancelling":
            final, allowed_from = "cancelled", ("cancelling",)
        await _write_files(store, batch_id, final, lines)
        allowed_from = (*allowed_from, "finalizing")
    await store.transition(batch_id, final, allowed_from)
    return final


async def _write_files(store: Store, batch_id: str, final: str, lines: list[InputLine]) -> None:
    results = await store.results(batch_id)
    ok = [results[n] for n in sorted(results) if results[n]["response"]["status_code"] == 200]
    bad = [results[n] for n in sorted(results) if results[n]["response"]["status_code"] != 200]
    if final in ("cancelled", "expired"):  # as OpenAI: every custom_id in one file
        bad += [unrun_row(line, final).to_dict() for line in lines if line.number not in results]
    fields = {}
    owner = await store.batch_owner(batch_id)  # the files are the batch's tenant's, counted
    if ok:
        f = await store.create_file(f"{batch_id}_output.jsonl", "batch_output", _jsonl(ok), owner)
        fields["output_file_id"] = f["id"]
    if bad:
        f = await store.create_file(f"{batch_id}_error.jsonl", "batch_output", _jsonl(bad), owner)
        fields["error_file_id"] = f["id"]
    if fields:
        await store.update_batch(batch_id, **fields)
