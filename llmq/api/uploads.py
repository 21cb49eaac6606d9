"""POST /v1/files read as it streams in: the multipart body parsed piece by piece, the file's
content written to Redis in chunks as it arrives, its bytes and (for a batch input) its lines
counted on the way. A file over a limit is refused with a 400 as soon as the limit is passed;
the rest of the body is read and dropped, so the client gets the answer (not a reset
connection), and the file is never held whole in memory."""

from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from llmq.common.errors import InvalidRequest, LLMQError, QuotaExceeded
from llmq.common.storage.file_chunks import ChunkWriter
from llmq.common.storage.jsonl_lines import LineSplitter
from llmq.common.storage.store import Store
from llmq.common.tenants import ANONYMOUS

FILE_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")  # OpenAI's
MAX_FIELD_BYTES = 1024  # purpose and the like


@dataclass
class Part:
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


@dataclass
class Limits:
    max_bytes: int
    max_batch_lines: int
    quota: int = 0  # the tenant's stored bytes (0: counted, never refused)


class FileUpload:
    """The parser's callbacks collect; ``_drain`` does the async work after each piece."""

    def __init__(self, store: Store, limits: Limits, owner: str = ANONYMOUS):
        self.store = store
        self.limits = limits
        self.owner = owner
        self.reserved = 0  # bytes counted to the owner so far
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_id: str | None = None
        self.writer: ChunkWriter | None = None
        self.lines = LineSplitter()
        self.line_count = 0
        self.refused: LLMQError | None = None
        self._part = Part()
        self._header = (b"", b"")
        self._file_data: list[bytes] = []

    # ---- parser callbacks (sync) -----------------------------------------------------------
    def on_part_begin(self) -> None:
        self._part = Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header = (self._header[0] + data[start:end], self._header[1])

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header = (self._header[0], self._header[1] + data[start:end])

    def on_header_end(self) -> None:
        self._part.headers.append((self._header[0].lower(), self._header[1]))
        self._header = (b"", b"")

    def on_headers_finished(self) -> None:
        disposition = dict(self._part.headers).get(b"content-disposition", b"")
        _, options = parse_options_header(disposition)
        self._part.name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in options and self._part.name == "file":
            if self.filename is not None:
                self.refused = InvalidRequest("send one file per request", "file")
                return
            self._part.filename = options[b"filename"].decode("utf-8", "replace")
            self.filename = self._part.filename or "upload.jsonl"

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part.filename is not None:
            self._file_data.append(data[start:end])
        elif len(self._part.data) + end - start > MAX_FIELD_BYTES:
            self.refused = InvalidRequest(f"the form field {self._part.name!r} is too long")
        else:
            self._part.data += data[start:end]

    def on_part_end(self) -> None:
        if self._part.filename is None:
            value = self._part.data.decode("utf-8", "replace")
            self.fields[self._part.name] = value
            if self._part.name == "purpose" and value not in FILE_PURPOSES:
                self.refused = _bad_purpose()

    # ---- the file's content ------------------------------------------------------------------
    async def drain(self) -> None:
        pieces, self._file_data = self._file_data, []
        if self.refused is not None:
            await self.discard()
            return
        for piece in pieces:
            if self.writer is None:
                self.file_id, self.writer = self.store.file_writer()
            if self.writer.size + len(piece) > self.limits.max_bytes:
                await self.refuse(
                    f"the file is over the limit of {self.limits.max_bytes} bytes",
                    "file_too_large",
                )
                return
            self.line_count += len(self.lines.feed(piece))
            if self._too_many_lines():
                await self.refuse_lines()
                return
            try:  # each piece counted before it is stored: the quota is never passed
                await self.store.reserve(self.owner, len(piece), self.limits.quota)
            except QuotaExceeded as exc:
                self.refused = exc
                await self.discard()
                return
            self.reserved += len(piece)
            await self.writer.write(piece)

    def _too_many_lines(self) -> bool:
        # Only a batch input is held to the line limit; the purpose may come after the file.
        purpose = self.fields.get("purpose")
        return purpose in (None, "batch") and self.line_count > self.limits.max_batch_lines

    async def refuse_lines(self) -> None:
        if self.fields.get("purpose") == "batch":
            limit = self.limits.max_batch_lines
            await self.refuse(
                f"a batch input file has at most {limit} requests (lines); this one has more",
                "too_many_lines",
            )

    async def refuse(self, message: str, code: str) -> None:
        self.refused = InvalidRequest(message, "file", code)
        await self.discard()

    async def discard(self) -> None:
        """Drop what was stored of the file (refused, or the upload broke off)."""
        if self.writer is not None:
            await self.writer.discard()
            self.writer = None
        await self.store.unreserve(self.owner, self.reserved)
        self.reserved = 0

    async def finish(self) -> dict:
        """The stored file's object, or the error that refused it."""
        purpose = self.fields.get("purpose")
        if self.refused is None and purpose is not None:
            self.line_count += len(self.lines.close())
            if self._too_many_lines():
                await self.refuse_lines()
        if self.refused is not None:
            raise self.refused
        if self.filename is None:
            raise InvalidRequest("a file is required (form field 'file')", "file")
        if purpose not in FILE_PURPOSES:
            await self.discard()
            raise _bad_purpose()
        if self.writer is None:
            self.file_id, self.writer = self.store.file_writer()
        await self.writer.close()
        size = self.writer.size
        return await self.store.commit_file(self.file_id, self.filename, purpose, size, self.owner)


def _bad_purpose() -> InvalidRequest:
    return InvalidRequest(f"purpose must be one of {', '.join(FILE_PURPOSES)}", "purpose")


def _boundary(request: Request) -> bytes:
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    if kind != b"multipart/form-data" or b"boundary" not in options:
        raise InvalidRequest("send the file as multipart/form-data (fields file and purpose)")
    return options[b"boundary"]


async def receive_file(request: Request, store: Store, limits: Limits, owner: str) -> dict:
    """Parse the upload as it arrives and store its file as ``owner``'s; the file object, or
    a 400 (a 429 past the owner's quota)."""
    upload = FileUpload(store, limits, owner)
    callbacks = {
        name: getattr(upload, name)
        for name in (
            "on_part_begin",
            "on_part_data",
            "on_part_end",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_headers_finished",
        )
    }
    try:
        parser = MultipartParser(_boundary(request), callbacks)  # type: ignore[arg-type]
    except (FormParserError, ValueError):
        raise InvalidRequest("the multipart boundary is malformed") from None
    malformed = (FormParserError, ValueError, UnicodeError)
    try:
        async for piece in request.stream():
            if upload.refused is not None:
                continue  # read and dropped, so that the client gets the answer
            try:
                parser.write(piece)
            except malformed:
                upload.refused = InvalidRequest("the multipart body is malformed")
            await upload.drain()
        if upload.refused is None:
            try:
                parser.finalize()
            except malformed:
                upload.refused = InvalidRequest("the multipart body is malformed")
        return await upload.finish()
    except BaseException:
        await upload.discard()  # the client left, or Redis failed: nothing half-stored stays
        raise
