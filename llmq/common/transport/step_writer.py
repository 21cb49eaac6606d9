"""A worker's output, written once a step: one STEP_SCRIPT call logs every request's new tokens
in the worker's log, publishes one message per API process, and finishes the requests that
ended; every ``CONSOLIDATE_EVERY`` steps it also moves the tails into the requests' lists.

The log's length fences the whole step: a claimer adds a mark to the old owner's log, and
Redis losing its tail shortens it (and breaks this worker's connection, after which it checks
again anyway); either way the step writes nothing and this worker writes every request it
holds alone (WRITE_SCRIPT: owner checked, record mended), then goes on from the log's length
as it found it."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import redis

from llmq.common.protocol import OutputMessage
from llmq.common.transport.keys import Keys, as_text
from llmq.common.transport.output_log import (
    CONSOLIDATE_EVERY,
    Tail,
    encode_frame,
    encode_logprobs,
    encode_value,
    frame_value,
)
from llmq.common.transport.script_pipeline import script_pipeline
from llmq.common.transport.scripts import STEP_SCRIPT, WRITE_SCRIPT, sharded


@dataclass(slots=True)
class Emission:
    """One request's news from one engine step, for ``EngineTransport.emit``."""

    request_id: str
    entry_id: str
    message: OutputMessage
    reply_to: str = ""  # its API process's channel and its key there ('': its own channel)


@dataclass(slots=True)
class Refusal:
    """A write the transport refused for a request: another worker owns it now (``owner``, the
    worker that claimed it), or its record lost its tail (``recorded``: the tokens it holds)."""

    request_id: str
    entry_id: str
    owner: str | None = None
    recorded: int | None = None
    message: OutputMessage | None = None  # what was refused for a lost tail


@dataclass(slots=True)
class _Held:
    """A request this worker writes for: its entry, its channel and its key in the frames
    there, its tail not yet moved."""

    entry_id: str
    channel: str
    key: str
    tail: Tail


@dataclass(slots=True)
class _Op:
    """One request's per-request work in a step: a move, a final, prompt logprobs."""

    request_id: str
    held: _Held
    final: OutputMessage | None = None
    prompt_logprobs: str | None = None


@dataclass(slots=True)
class _Sent:
    """One emission as it goes out: the request's channel and key there, its frame value."""

    request_id: str
    channel: str
    key: str
    value: str


class StepWriter:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        worker: str,
        stream: str,
        ttl: int,
        sha: Callable[[str], str],
    ):
        self.r = client
        self._sha = sha  # the transport's: a script's SHA, loaded into Redis once
        self.keys = keys
        self.worker = worker
        self.stream = stream
        self.ttl = ttl
        self.log = keys.log(worker)
        # In a cluster, a frame goes out on a sharded channel in its model's slot (SPUBLISH:
        # only the node that owns the slot carries it, not every node of the cluster).
        self._step_script = sharded(STEP_SCRIPT) if keys.cluster else STEP_SCRIPT
        self._write_script = sharded(WRITE_SCRIPT) if keys.cluster else WRITE_SCRIPT
        self.held: dict[str, _Held] = {}
        self._length: int | None = None  # the log's length as this worker left it
        self._steps = 0
        self._refreshed = 0.0  # when the log's TTL was last set

    def reset(self) -> None:
        """After an outage: the log to check."""
        self._length = None

    def hold(self, request_id: str, entry_id: str, reply_to: str, recorded: int) -> None:
        self.held[request_id] = self._held(request_id, entry_id, reply_to, recorded)

    def _held(self, request_id: str, entry_id: str, reply_to: str, first: int) -> _Held:
        """``reply_to`` is ``<channel>#<key>`` (the API's); none: the request's own channel,
        under its id (a request written by hand, followed with redis-cli)."""
        channel, _, key = reply_to.partition("#")
        return _Held(entry_id, channel or self.keys.out(request_id), key or request_id, Tail(first))

    def forget(self, request_id: str) -> None:
        self.held.pop(request_id, None)

    # ---- one step ------------------------------------------------------------------------
    def emit(self, emissions: list[Emission]) -> list[Refusal]:
        sent, ops = self._apply(emissions)
        if not sent and not ops:
            return []
        move = self._steps + 1 >= CONSOLIDATE_EVERY and any(
            h.tail.tokens for h in self.held.values()
        )
        if move:
            finals = {op.request_id for op in ops}
            ops += [
                _Op(rid, h) for rid, h in self.held.items() if h.tail.tokens and rid not in finals
            ]
        if self._length is None:
            return self._write_alone(sent, ops)
        reply = self._step(sent, ops, move)
        if as_text(reply[0]) == "check":
            return self._write_alone(sent, ops)
        self._length = int(reply[0])
        self._steps = 0 if move else self._steps + 1
        refused = {int(reply[i]) - 1: as_text(reply[i + 1]) for i in range(1, len(reply), 2)}
        return self._settle(ops, refused)

    def _apply(self, emissions: list[Emission]) -> tuple[list[_Sent], list[_Op]]:
        """Add the emissions' tokens to their tails: what goes out, and the per-request work
        it needs."""
        sent, ops = [], []
        for e in emissions:
            msg = e.message
            held = self.held.get(e.request_id)
            if held is None and not msg.done:  # not this worker's (any more): not sent
                continue
            if held is None:  # failed before it was taken into service
                held = self._held(e.request_id, e.entry_id, e.reply_to, msg.index)
            lps = encode_logprobs(msg)
            held.tail.add(msg.index, msg.tokens, lps)
            sent.append(_Sent(e.request_id, held.channel, held.key, frame_value(msg, lps)))
            prompt = msg.prompt_logprobs
            if msg.done or prompt is not None:
                encoded = None if prompt is None else json.dumps(prompt, separators=(",", ":"))
                ops.append(_Op(e.request_id, held, msg if msg.done else None, encoded))
        return sent, ops

    def _step(self, sent: list[_Sent], ops: list[_Op], move: bool) -> list:
        channels: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for s in sent:
            channels[s.channel].append((s.key, s.value))
        keys = [self.log, self.stream]
        now = time.time()
        # The log lives while its worker writes (a claimer reads it after the worker died):
        # its TTL is refreshed a few times a TTL, not every step.
        refresh = now - self._refreshed > self.ttl / 3
        if move or refresh:
            self._refreshed = now
        flag = "1" if move else "e" if refresh else "0"
        args: list = [self._length, self.worker, now, self.ttl, flag]
        args.append(len(channels))
        for channel, records in channels.items():
            args += [channel, encode_frame(records)]
        for op in ops:
            k = self.keys
            keys += [k.req(op.request_id), k.tokens(op.request_id)]
            args += _op_args(op)
        return self.r.evalsha(self._sha(self._step_script), len(keys), *keys, *args)

    def _settle(self, ops: list[_Op], refused: dict[int, str]) -> list[Refusal]:
        """Bookkeeping after a step: tails moved, requests ended, refusals for the loop."""
        refusals = []
        for i, op in enumerate(ops):
            why = refused.get(i)
            if why is None:
                if op.final is not None:
                    self.forget(op.request_id)
                else:  # a move (or prompt logprobs, which carry the tail with them)
                    op.held.tail.moved()
                continue
            refusals.append(self._refusal(op.request_id, op.held, why, op.final))
        return refusals

    def _refusal(self, rid: str, held: _Held, why: str, final: OutputMessage | None) -> Refusal:
        kind, _, detail = why.partition(":")
        if kind == "fenced":
            self.forget(rid)
            return Refusal(rid, held.entry_id, owner=detail)
        tail = held.tail
        message = OutputMessage(
            index=tail.first,
            tokens=list(tail.tokens),
            logprobs=[json.loads(x) for x in tail.logprobs] if tail.logprobs else None,
            finish_reason=final.finish_reason if final else None,
            error=final.error if final else None,
        )
        held.tail = Tail(int(detail))
        return Refusal(rid, held.entry_id, recorded=int(detail), message=message)

    # ---- the log changed under this worker -----------------------------------------------
    def _write_alone(self, sent: list[_Sent], ops: list[_Op]) -> list[Refusal]:
        """Every request this worker holds (and this step's others) written alone, its owner
        checked and its record mended; then on from the log's length, read first, so that a
        claim after these checks changes it again."""
        length = self.r.xlen(self.log)
        with_ops = {op.request_id: op for op in ops}
        values = {s.request_id: s.value for s in sent}
        rids = list(dict.fromkeys([*self.held, *with_ops]))
        alone = [with_ops.get(rid) or _Op(rid, self.held[rid]) for rid in rids]
        pipe = script_pipeline(self.r)
        sha = self._sha(self._write_script)
        for op in alone:
            rid, k = op.request_id, self.keys
            keys = (k.req(rid), k.tokens(rid), op.held.channel, self.stream)
            value = values.get(rid)
            payload = encode_frame([(op.held.key, value)]) if value is not None else ""
            pipe.evalsha(sha, 4, *keys, *self._write_args(op, payload))
        refusals = []
        for op, reply in zip(alone, pipe.execute(), strict=True):
            if reply != 0:
                refusals.append(self._refusal(op.request_id, op.held, as_text(reply), op.final))
            elif op.final is not None:
                self.forget(op.request_id)
            else:
                op.held.tail.moved()
        self._length = int(length)
        self._steps = 0
        return refusals

    def _write_args(self, op: _Op, payload: str) -> list:
        """WRITE_SCRIPT's arguments (scripts.py)."""
        tail, final = op.held.tail, op.final
        flags = ("p" if op.prompt_logprobs else "") + ("f" if final else "")
        flags += "" if payload else "q"
        args = [self.worker, op.held.entry_id, tail.first, len(tail.tokens), payload, flags]
        args.append(encode_value(tail.first, tail.tokens, tail.logprobs))
        if op.prompt_logprobs:
            args.append(op.prompt_logprobs)
        if final is not None:
            args += [*_ending(final), time.time(), self.ttl]
        return args


def _op_args(op: _Op) -> list:
    """One op of STEP_SCRIPT (scripts.py): the tail as one value."""
    tail, final = op.held.tail, op.final
    flags = "a" + ("p" if op.prompt_logprobs else "") + ("f" if final is not None else "")
    value = encode_value(tail.first, tail.tokens, tail.logprobs)
    args = [flags, op.held.entry_id, tail.first, len(tail.tokens), value]
    if op.prompt_logprobs:
        args.append(op.prompt_logprobs)
    if final is not None:
        args += _ending(final)
    return args


def _ending(final: OutputMessage) -> list[str]:
    """A final message's state, finish_reason and error, as the scripts record them."""
    error = final.error.message if final.error else ""
    return ["failed" if final.error else "finished", final.finish_reason or "", error]
