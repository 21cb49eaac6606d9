"""Cache-aware placement, the choice itself (no Redis): which live worker a request goes to.

A worker's cost for a prompt is the prompt tokens it would compute (those past the longest
prefix of the prompt's blocks it holds: ``block_hashes``) plus ``load_weight`` times its load
(the tokens it has still to compute: its heartbeat's ``pending_tokens``, less the prompts this
process has seen computed since (their first tokens came back), plus what it placed there since
and has not seen computed). The cheapest wins: a prefix cached on a busy worker still
draws its requests while the work it spares outweighs the queue it would wait behind; with
nothing cached anywhere the least loaded wins.

What a worker holds is its published set of block hashes (``Keys.cached``, refreshed with its
heartbeat), and, until that shows them, the prompts this process has just placed on it
(``RecentPlacements``): the second request of a burst sharing a prefix follows the first.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass

# How long a placement counts as the worker's without its published set showing it: longer
# than a heartbeat (its set is refreshed with it) plus the API's engine cache (1 s).
RECENT_S = 3.0
_RECENT_MAX = 200_000  # block hashes remembered at most
_SENT_S = 10.0  # how long a placement is remembered for its load
_OPEN_MAX = 100_000  # placements awaiting their first token, remembered at most


@dataclass(slots=True)
class Candidate:
    worker: str
    held_blocks: int  # leading blocks of the prompt it holds (or was just sent)
    load_tokens: int  # tokens it has still to compute
    extra_tokens: int = 0  # work it would do first, as tokens (reading a LoRA adapter)


def cost(c: Candidate, prompt_tokens: int, block_size: int, load_weight: float) -> float:
    """Tokens this request would compute there, plus its load weighed. At least one prompt
    token is always computed (its step yields the first output token)."""
    spared = min(c.held_blocks * block_size, max(prompt_tokens - 1, 0))
    return prompt_tokens - spared + c.extra_tokens + load_weight * c.load_tokens


def choose(
    candidates: list[Candidate],
    prompt_tokens: int,
    block_size: int,
    load_weight: float,
    rng: random.Random | None = None,
) -> Candidate | None:
    """The cheapest candidate; ties go to a random one of them (a burst whose loads are not
    known yet spreads instead of piling onto the first name)."""
    if not candidates:
        return None
    costs = [cost(c, prompt_tokens, block_size, load_weight) for c in candidates]
    best = min(costs)
    tied = [c for c, x in zip(candidates, costs, strict=True) if x == best]
    return (rng or random).choice(tied)


@dataclass(slots=True)
class _Sent:
    at: float
    tokens: int
    tracked: bool = False  # its first token will be seen (placed with a request id)
    computed_at: float | None = None  # when its first token came back (its prompt computed)


class RecentPlacements:
    """What this process placed where lately: the block hashes of each prompt it sent to a
    worker (until its published set takes over), and the tokens it sent each worker, until
    their prompt is seen computed (its load until a heartbeat counts them).

    A heartbeat is a snapshot: one written while a burst's prompts were being computed still
    shows them pending for up to a heartbeat and the API's engine cache (2 s) after they are
    done, and without the computed ones taken off, an idle worker without a prefix looked
    cheaper than its busy-looking holder (a repeated burst missed its cache)."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self._blocks: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._sent: dict[str, list[_Sent]] = {}
        self._open: OrderedDict[str, _Sent] = OrderedDict()  # by request id

    def record(self, worker: str, hashes: list[int], tokens: int, request_id: str = "") -> None:
        now = self.clock()
        for h in hashes:
            self._blocks[h] = (worker, now)
            self._blocks.move_to_end(h)
        while len(self._blocks) > _RECENT_MAX:
            self._blocks.popitem(last=False)
        sent = self._sent.setdefault(worker, [])
        placement = _Sent(now, tokens, tracked=bool(request_id))
        sent.append(placement)
        if request_id:
            self._open[request_id] = placement
            while len(self._open) > _OPEN_MAX:
                self._open.popitem(last=False)
        if len(sent) > 64 and now - sent[0].at > _SENT_S:
            self._sent[worker] = [s for s in sent if now - s.at <= _SENT_S]

    def computed(self, request_id: str) -> None:
        """The request's first token came back: its prompt is no longer the worker's load."""
        placement = self._open.pop(request_id, None)
        if placement is not None:
            placement.computed_at = self.clock()

    def held_blocks(self, worker: str, hashes: list[int], published: int) -> int:
        """Leading blocks of ``hashes`` the worker holds: the ``published`` ones its set
        shows, then those this process sent it lately."""
        now = self.clock()
        held = published
        while held < len(hashes):
            seen = self._blocks.get(hashes[held])
            if seen is None or seen[0] != worker or now - seen[1] > RECENT_S:
                break
            held += 1
        return held

    def load(self, worker: str, heartbeat_pending: int, heartbeat_time: float) -> int:
        """The worker's load: its heartbeat's, less the prompts placed before it and seen
        computed after it, plus what this process sent it since; and never less than what this
        process sent it and has not seen computed. The larger of the two, not their sum: a
        prompt placed just before a heartbeat may or may not be in it, and counted twice a
        burst's holder looked busier than an idle worker without its prefix."""
        now = self.clock()
        done_since = sent_since = still_open = 0
        for s in self._sent.get(worker, ()):
            if s.tracked and s.computed_at is None and now - s.at <= _SENT_S:
                still_open += s.tokens
            if s.at > heartbeat_time:
                sent_since += s.tokens if s.computed_at is None else 0
            elif s.computed_at is not None and s.computed_at > heartbeat_time:
                done_since += s.tokens
        return max(max(0, heartbeat_pending - done_since) + sent_since, still_open)
