"""A request's output record: a list of its tokens' values in Redis, written in bulk now and
then, and the tail generated since, in its worker's step log.

Redis work per step, not per token: a worker appends one entry a step to its own log stream
(``{p}:log:{worker}``: the frames it published that step), and moves the tails into the requests' lists only every ``CONSOLIDATE_EVERY`` steps (and when a request ends),
so a step costs a few Redis commands whatever its batch (docs/performance.md, "How many workers
can one Redis feed?").
Readers (a client filling a gap, a claimer, a worker taking its own requests back) read both:
the list, then the owner's log values for the request, merged by position.

A step's log entry holds what the step published, a field per API process's channel (its
frame, ``encode_frame``). A request's value in it, and each element of its record (a list of
values, one a move: Redis handles one string a request, not one a token), is
``index|t1,t2,...|lp1\\nlp2...`` (the logprob entries as compact JSON, one a line; JSON never
holds a raw newline): Lua finds where a value ends without a JSON parser (``scripts``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llmq.common.protocol import OutputMessage

# Steps between two moves of every tail into its request's list (and a trim of the log). A
# claimer or a reader scans at most this many log entries; 64 makes the moves cost about 0.03
# Redis commands per token at 64 streams.
CONSOLIDATE_EVERY = 64
# The field a claimer adds to the old owner's log: its next step sees the log changed under it.
CLAIM_MARK = "~claimed"


def encode_frame(records: list[tuple[str, str]]) -> str:
    """One step's messages for one API process, published and logged as they are (one copy
    into Redis, not two: copying an argument inside a script costs Redis CPU, docs/performance.md):
    ``\\x1e<key>\\x1f<value>`` for each (key, ``frame_value``)."""
    return "".join(f"\x1e{key}\x1f{value}" for key, value in records)


def frame_value(msg: OutputMessage, logprobs: list[str] | None) -> str:
    """A message in a frame: compact (``encode_value``, its ``encode_logprobs``) for tokens
    only, else its JSON (a final, an error, prompt logprobs; their tokens reach the record
    with the step's per-request work)."""
    plain = msg.finish_reason is None and msg.error is None and msg.usage is None
    plain = plain and msg.worker is None and msg.embeddings is None
    if not plain or msg.prompt_logprobs is not None:
        return msg.to_json()
    return encode_value(msg.index, msg.tokens, logprobs)


def encode_logprobs(msg: OutputMessage) -> list[str] | None:
    """A message's logprob entries as compact JSON, as records and frames hold them."""
    if not msg.tokens or not msg.logprobs:
        return None
    return [json.dumps(lp, separators=(",", ":")) for lp in msg.logprobs]


def decode_frame(raw: str | bytes) -> dict[str, OutputMessage]:
    """The messages of ``encode_frame``, by request id."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    messages = {}
    for record in text.split("\x1e")[1:]:
        rid, _, value = record.partition("\x1f")
        if value.startswith("{"):
            messages[rid] = OutputMessage.from_json(value)
        else:
            index, tokens, lps = decode_value(value)
            messages[rid] = OutputMessage(index=index, tokens=tokens, logprobs=lps)
    return messages


def encode_value(index: int, tokens: list[int], logprobs: list[str] | None) -> str:
    value = f"{index}|{','.join(map(str, tokens))}"
    return value + "|" + "\n".join(logprobs) if logprobs else value


def decode_value(value: str, logprobs: bool = True) -> tuple[int, list[int], list[dict] | None]:
    """A value's first index, tokens and (when ``logprobs`` and it has them) logprob entries;
    ValueError for a string that is not a value."""
    index, bar, rest = value.partition("|")
    if not bar:
        raise ValueError(f"not a record value: {value[:40]!r}")
    tokens, _, lps = rest.partition("|")
    ids = [int(t) for t in tokens.split(",")] if tokens else []
    entries = [json.loads(x) for x in lps.split("\n")] if lps and logprobs else None
    return int(index), ids, entries


@dataclass(slots=True)
class Tail:
    """Tokens [first, first + len(tokens)) of a request: sent and logged, not yet in its list.
    ``logprobs`` runs beside the tokens (compact JSON each) when the request asked for them."""

    first: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[str] | None = None

    @property
    def end(self) -> int:
        return self.first + len(self.tokens)

    def add(self, index: int, tokens: list[int], logprobs: list[str] | None) -> None:
        """Place tokens sent at ``index``: a message sent again after an outage overwrites its
        own positions; the part before ``first`` is in the list already."""
        skip = max(0, self.first - index)
        tokens, at = tokens[skip:], index + skip - self.first
        if at > len(self.tokens) or not tokens:
            return
        self.tokens[at : at + len(tokens)] = tokens
        if logprobs is not None and (self.logprobs is not None or at == 0):
            self.logprobs = (self.logprobs or [])[:at] + logprobs[skip:]
        else:  # a request's messages carry logprobs all or none
            self.logprobs = None

    def moved(self) -> None:
        """The tail is in the list now."""
        self.first, self.tokens, self.logprobs = self.end, [], None


def merge(values: list[str], logprobs: bool = False) -> tuple[list[int], list[dict] | None]:
    """A request's tokens (and, with ``logprobs``, their entries) from its record's values and
    then its log's, in order: overlaps dropped, a value past a hole ends it."""
    tokens: list[int] = []
    entries: list[dict] | None = [] if logprobs else None
    for value in values:
        index, ids, value_lps = decode_value(value, logprobs)
        if index > len(tokens):
            break
        if entries is not None and len(entries) == len(tokens) and value_lps is not None:
            entries.extend(value_lps[len(tokens) - index :])
        tokens.extend(ids[len(tokens) - index :])
    return tokens, entries
