"""The end of a batch: its output and error files written a slice of lines at a time (every
input line exactly once: its recorded row, or an error row when it has none), then its final
state, set only while the run still holds the batch's lease, and its checkpoint deleted."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from llmq.common.storage.batch_checkpoint import LineCheckpoint
from llmq.common.storage.file_chunks import FileGone
from llmq.common.storage.jsonl_lines import InputLine
from llmq.common.storage.store import Store
from llmq.worker.batch.input_lines import input_lines
from llmq.worker.batch.results import is_output_row, unrun_row

log = logging.getLogger("llmq.batch")

SLICE = 500  # lines whose rows are read in one round trip


class OutFile:
    """One of the batch's files, written as its rows come; a file object once committed."""

    def __init__(self, store: Store, filename: str, owner: str):
        self.store = store
        self.filename = filename
        self.owner = owner  # the batch's tenant's: counted to it, never refused
        self.file_id, self.writer = store.file_writer()
        self.rows = 0

    async def write(self, row: bytes) -> None:
        self.rows += 1
        await self.writer.write(row + b"\n")

    async def commit(self) -> str | None:
        """The file's id; None (and nothing stored) when it has no rows."""
        await self.writer.close()
        if not self.rows:
            return None
        size = self.writer.size
        await self.store.reserve(self.owner, size, quota=0)
        await self.store.commit_file(self.file_id, self.filename, "batch_output", size, self.owner)
        return self.file_id


async def _rows_by_input(
    store: Store, checkpoint: LineCheckpoint, input_file_id: str, final: str
) -> AsyncIterator[bytes]:
    """Every input line's row, in the file's order: read a slice of lines, then their rows."""
    group: list[InputLine] = []

    async def rows_of(lines: list[InputLine]) -> list[bytes]:
        rows = await checkpoint.rows(line.number for line in lines)
        return [
            rows.get(line.number)
            or json.dumps(unrun_row(line, final).to_dict(), separators=(",", ":")).encode()
            for line in lines
        ]

    async for line in input_lines(store, input_file_id):
        group.append(line)
        if len(group) == SLICE:
            for row in await rows_of(group):
                yield row
            group = []
    for row in await rows_of(group):
        yield row


async def _write(rows: AsyncIterator[bytes], out: OutFile, err: OutFile) -> None:
    async for row in rows:
        await (out if is_output_row(row) else err).write(row)


async def write_files(
    store: Store, checkpoint: LineCheckpoint, batch_id: str, input_file_id: str, final: str
) -> list[str | None]:
    """Write the batch's files; returns the ids written (output, then error; None when a file
    has no rows). Without its input file (deleted meanwhile) the recorded rows are written as
    they are, in no particular order."""
    owner = await store.batch_owner(batch_id)
    for by_input in (True, False):
        if by_input and await store.get_file(input_file_id) is None:
            continue
        out = OutFile(store, f"{batch_id}_output.jsonl", owner)
        err = OutFile(store, f"{batch_id}_error.jsonl", owner)
        if by_input:
            rows = _rows_by_input(store, checkpoint, input_file_id, final)
        else:
            rows = (row async for _, row in checkpoint.scan())
        try:
            await _write(rows, out, err)
        except FileGone:
            log.warning("batch %s: its input file went away while finalizing", batch_id)
            await out.writer.discard()
            await err.writer.discard()
            continue
        return [await out.commit(), await err.commit()]
    raise AssertionError("the recorded rows are always there to write")


async def finalize(
    store: Store,
    checkpoint: LineCheckpoint,
    batch: dict,
    final: str,
    allowed_from: tuple[str, ...],
    owner: str,
) -> str | None:
    """Write the batch's files (unless it failed validation) and move it to ``final``; returns
    the state it was moved to, or None when this run no longer holds the lease (then another
    run finishes the batch, and nothing this one wrote stays)."""
    batch_id = batch["id"]
    fields: dict[str, str] = {}
    written: list[str] = []
    if final != "failed":
        moved = await store.transition(batch_id, "finalizing", ("in_progress",), owner)
        if moved is None and await store.lease_holder(batch_id) != owner:
            return None
        # A cancel that landed after the last line: end the batch cancelled (with every
        # line), not stuck in "cancelling" until a re-dispatched task finalizes it again.
        if moved is None and final == "completed" and await store.status(batch_id) == "cancelling":
            final, allowed_from = "cancelled", ("cancelling",)
        ids = await write_files(store, checkpoint, batch_id, batch["input_file_id"], final)
        for name, file_id in zip(("output_file_id", "error_file_id"), ids, strict=True):
            if file_id is not None:
                fields[name] = file_id
                written.append(file_id)
        allowed_from = (*allowed_from, "finalizing")
    if await store.transition(batch_id, final, allowed_from, owner, fields) is None:
        owner = await store.batch_owner(batch_id)
        for file_id in written:  # referenced by no batch: deleted, their bytes given back
            await store.delete_file(file_id, owner)
        if await store.lease_holder(batch_id) != owner:
            return None
        return await store.status(batch_id)
    await checkpoint.delete()
    return final
