"""Cache-aware placement, the choice itself (no Redis): which live worker a request goes to.

A worker's cost for a prompt is the prompt tokens it would compute (those past the longest
prefix of the prompt's blocks it holds: ``block_hashes``) plus ``load_weight`` times its load
(the tokens it has still to compute: its heartbeat's ``pending_tokens``, plus what this process
placed on it since that heartbeat). The cheapest wins: a prefix cached on a busy worker still
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
# Placements counted as load on top of a heartbeat written before them, to this margin (a
# request placed just before a heartbeat may not have been pulled by then).
_LOAD_MARGIN_S = 0.5
_RECENT_MAX = 200_000  # block hashes remembered at most


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


class RecentPlacements:
    """What this process placed where lately: the block hashes of each prompt it sent to a
    worker (until its published set takes over), and the tokens it sent each worker (its load
    until a heartbeat counts them)."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self._blocks: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._sent: dict[str, list[tuple[float, int]]] = {}

    def record(self, worker: str, hashes: list[int], tokens: int) -> None:
        now = self.clock()
        for h in hashes:
            self._blocks[h] = (worker, now)
            self._blocks.move_to_end(h)
        while len(self._blocks) > _RECENT_MAX:
            self._blocks.popitem(last=False)
        sent = self._sent.setdefault(worker, [])
        sent.append((now, tokens))
        if len(sent) > 64 and now - sent[0][0] > 10:
            self._sent[worker] = [s for s in sent if now - s[0] <= 10]

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
        """The worker's load: its heartbeat's, plus what this process sent it since."""
        since = heartbeat_time - _LOAD_MARGIN_S
        sent = sum(t for at, t in self._sent.get(worker, ()) if at > since)
        return heartbeat_pending + sent
