"""The worker's side of cache-aware placement (mixed into ``EngineTransport``).

The API names in each entry the worker it chose (field ``target``: ``common/placement/policy.py``).
Entries stay in the model's one stream and consumer group, so every guarantee of the queue
holds as it is: whichever worker reads an entry placed on another hands it over, moving it from
its own pending list into the target's (``HANDOVER_SCRIPT``, one XCLAIM) and telling it on the
cancel channel; the target takes the entries handed to it from its pending list as it has room.
An entry is in one pending list at every moment, and one of a worker that dies is claimed from
that list as before. A reader keeps an entry whose target is gone (no heartbeat) or full (its
KV cache used up with requests waiting).

Each worker publishes the block hashes its prefix cache holds (``Keys.cached``, a set updated
with what was cached and evicted since the last heartbeat), which the API matches prompts to.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from llmq.common.transport.keys import GROUP, HANDOVER_PREFIX, as_text
from llmq.common.transport.script_pipeline import script_pipeline
from llmq.common.transport.scripts import HANDOVER_SCRIPT

log = logging.getLogger(__name__)

# A target whose KV cache is this full with requests waiting keeps nothing more handed to it.
_FULL_KV_SHARE = 0.98
_PEL_SCAN = 10_000  # entries of its own pending list a worker lists to find those handed to it
_SET_CHUNK = 2_000  # members per SADD / SREM


class PlacementSide:
    """Uses the transport's ``r``, ``keys``, ``stream``, ``worker``, ``_sha``, ``_parse`` and
    ``_take_fresh``."""

    def _init_placement(self, enabled: bool) -> None:
        self.placement = enabled
        # Entries were handed over to this worker (or may have been): look in its pending list.
        self.handover_waiting = enabled
        self._taken: set[str] = set()  # entries of its pending list it has taken into service
        self._published: set[int] | None = None  # what its cached set holds (None: rewrite)

    def _note_taken(self, pulled: Iterable) -> None:
        self._taken.update(p.entry_id for p in pulled)

    # ---- handing over --------------------------------------------------------------------
    def _hand_over(self, entries: list[tuple]) -> list[tuple]:
        """The entries read that stay with this worker; those placed on another live worker
        with room are handed over to it."""
        if not self.placement:
            return entries
        placed = {}
        for eid, fields in entries:
            target = _field(fields, "target")
            if target and target != self.worker and _field(fields, "id"):
                placed[as_text(eid)] = (target, _field(fields, "id"))
        if not placed:
            return entries
        takers = self._takers({t for t, _ in placed.values()})
        moves = [(eid, t, rid) for eid, (t, rid) in placed.items() if t in takers]
        if not moves:
            return entries
        pipe = script_pipeline(self.r)
        sha = self._sha(HANDOVER_SCRIPT)
        for eid, target, rid in moves:
            pipe.evalsha(sha, 2, self.stream, self.keys.req(rid), GROUP, self.worker, target, eid)
        handed = {eid: t for (eid, t, _), ok in zip(moves, pipe.execute(), strict=True) if ok}
        for target in set(handed.values()):
            self.r.publish(self.keys.cancel, HANDOVER_PREFIX + target)
        return [(eid, f) for eid, f in entries if as_text(eid) not in handed]

    def _takers(self, targets: set[str]) -> set[str]:
        """The targets alive (a heartbeat) and not full."""
        names = sorted(targets)
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.hmget(self.keys.engine(name), "kv_blocks_used", "kv_blocks_total", "waiting")
        takers = set()
        for name, (used, total, waiting) in zip(names, pipe.execute(), strict=True):
            if total is None:
                continue  # no heartbeat: gone (its pending list is claimed when it expires)
            used, total, waiting = int(used or 0), int(total or 0), int(waiting or 0)
            if total and used >= _FULL_KV_SHARE * total and waiting > 0:
                continue
            takers.add(name)
        return takers

    def pull_handed(self, count: int) -> list:
        """Up to ``count`` of the entries handed over to this worker (in its pending list, not
        yet taken), taken into service."""
        self.handover_waiting = False
        if count <= 0 or not self.placement:
            self.handover_waiting = self.placement
            return []
        rows = self.r.xpending_range(
            self.stream, GROUP, "-", "+", _PEL_SCAN, consumername=self.worker
        )
        pending = {as_text(r["message_id"]): int(r["times_delivered"]) for r in rows}
        self._taken &= pending.keys()
        new = [eid for eid in pending if eid not in self._taken]
        if len(new) > count:
            self.handover_waiting = True
            new = new[:count]
        if not new:
            return []
        pipe = self.r.pipeline(transaction=False)
        for eid in new:
            pipe.xrange(self.stream, eid, eid)
        entries = []
        for eid, hits in zip(new, pipe.execute(), strict=True):
            if hits and hits[0][1]:
                entries.append(self._parse(eid, hits[0][1], max(pending[eid], 1)))
            else:  # deleted meanwhile
                self.r.xack(self.stream, GROUP, eid)
        self._note_taken(entries)
        return self._take_fresh(entries)

    # ---- what its cache holds ------------------------------------------------------------
    def publish_cached(self, hashes: Iterable[int], ttl: float) -> None:
        """Bring this worker's published set of cached block hashes up to date: what was
        cached and evicted since the last call (all of it after a setup)."""
        current = set(hashes)
        key = self.keys.cached(self.worker)
        pipe = self.r.pipeline(transaction=False)
        if self._published is None:
            pipe.delete(key)
            added, removed = current, set()
        else:
            added, removed = current - self._published, self._published - current
        for values, command in ((list(added), pipe.sadd), (list(removed), pipe.srem)):
            for i in range(0, len(values), _SET_CHUNK):
                command(key, *values[i : i + _SET_CHUNK])
        pipe.pexpire(key, int(ttl * 1000))
        pipe.execute()
        self._published = current

    def forget_cached(self) -> None:
        """Remove the published set (a worker leaving)."""
        self.r.delete(self.keys.cached(self.worker))
        self._published = None


def _field(fields: dict, name: str) -> str | None:
    value = fields.get(name.encode(), fields.get(name))
    return as_text(value) if value is not None else None
