"""Placement's choice and its memory of recent placements, in memory; the block hashes the
API computes equal the prefix cache's."""

from __future__ import annotations

import random

import pytest

from llmq.common.placement.block_hashes import chain_hashes, prompt_hashes
from llmq.common.placement.policy import RECENT_S, Candidate, RecentPlacements, choose
from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.sequence import Sequence

pytestmark = pytest.mark.unit

BS = 16


def test_the_api_hashes_equal_the_prefix_cache_hashes():
    tokens = list(range(100, 200))
    bm = BlockManager(num_blocks=32, block_size=BS)
    seq = Sequence("a", tokens)
    assert bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    assert set(bm.cached_hashes()) == set(prompt_hashes(tokens, BS))
    assert len(prompt_hashes(tokens, BS)) == len(tokens) // BS
    # A chain extended from a part computed before equals one computed at once.
    assert chain_hashes(tokens, BS, 6, chain_hashes(tokens, BS, 2)) == prompt_hashes(tokens, BS)
    # A different first block changes every hash after it.
    other = prompt_hashes([7, *tokens[1:]], BS)
    assert not set(other) & set(prompt_hashes(tokens, BS))


def test_the_worker_holding_the_prefix_wins_over_a_slightly_less_loaded_one():
    holder = Candidate("a", held_blocks=60, load_tokens=200)
    idle = Candidate("b", held_blocks=0, load_tokens=0)
    assert choose([holder, idle], 1024, BS, 1.0).worker == "a"


def test_a_hot_prefix_spills_to_an_idle_worker_once_the_holder_s_queue_outweighs_it():
    holder = Candidate("a", held_blocks=60, load_tokens=3000)
    idle = Candidate("b", held_blocks=0, load_tokens=0)
    assert choose([holder, idle], 1024, BS, 1.0).worker == "b"
    # With load weight 0 the cache alone decides.
    assert choose([holder, idle], 1024, BS, 0.0).worker == "a"


def test_nothing_cached_anywhere_goes_to_the_least_loaded():
    cands = [Candidate(w, 0, load) for w, load in (("a", 300), ("b", 40), ("c", 90))]
    assert choose(cands, 200, BS, 1.0).worker == "b"


def test_ties_spread_over_the_tied_workers():
    cands = [Candidate(w, 0, 0) for w in "abcd"]
    rng = random.Random(1)
    assert {choose(cands, 50, BS, 1.0, rng).worker for _ in range(64)} == set("abcd")
    assert choose([], 50, BS, 1.0) is None


def test_a_prompt_cached_whole_still_computes_its_last_token():
    whole = Candidate("a", held_blocks=4, load_tokens=0)  # 64 tokens, all cached
    other = Candidate("b", held_blocks=0, load_tokens=0)
    assert choose([whole, other], 64, BS, 1.0).worker == "a"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_follows_its_first_placement_until_the_published_set_shows_it():
    clock = FakeClock()
    recent = RecentPlacements(clock)
    hashes = prompt_hashes(list(range(64)), BS)
    assert recent.held_blocks("a", hashes, 0) == 0
    recent.record("a", hashes[:3], tokens=64)
    assert recent.held_blocks("a", hashes, 0) == 3  # what it was just sent
    assert recent.held_blocks("b", hashes, 0) == 0
    assert recent.held_blocks("a", hashes, 1) == 3  # published first, then recent
    clock.now += RECENT_S + 0.1
    assert recent.held_blocks("a", hashes, 0) == 0  # only the published set counts now
    assert recent.held_blocks("a", hashes, 2) == 2


def test_load_adds_what_was_sent_since_the_heartbeat():
    clock = FakeClock()
    recent = RecentPlacements(clock)
    recent.record("a", [], tokens=500)
    clock.now += 2.0
    recent.record("a", [], tokens=100)
    # A heartbeat written after the first placement counts it already.
    assert recent.load("a", heartbeat_pending=50, heartbeat_time=clock.now - 1.0) == 150
    assert recent.load("a", heartbeat_pending=0, heartbeat_time=clock.now - 5.0) == 600
    assert recent.load("b", heartbeat_pending=7, heartbeat_time=clock.now) == 7


def test_prompts_seen_computed_leave_the_load_a_stale_heartbeat_shows():
    clock = FakeClock()
    recent = RecentPlacements(clock)
    recent.record("a", [], tokens=500, request_id="r1")
    clock.now += 1.0
    beat = clock.now  # written while r1's prompt was computed: it shows it pending
    assert recent.load("a", heartbeat_pending=500, heartbeat_time=beat) == 500
    clock.now += 0.3
    recent.computed("r1")  # its first token came back after that heartbeat
    assert recent.load("a", heartbeat_pending=500, heartbeat_time=beat) == 0
    # Placed after the heartbeat: load until computed, then none.
    recent.record("a", [], tokens=200, request_id="r2")
    assert recent.load("a", heartbeat_pending=0, heartbeat_time=clock.now - 2) == 200
    recent.computed("r2")
    recent.computed("r2")  # a second first message (a resumed stream) changes nothing
    assert recent.load("a", heartbeat_pending=0, heartbeat_time=clock.now - 2) == 0
    # Computed before the heartbeat: that heartbeat's pending does not hold it.
    recent.record("b", [], tokens=300, request_id="r3")
    clock.now += 0.1
    recent.computed("r3")
    clock.now += 1.0
    assert recent.load("b", heartbeat_pending=30, heartbeat_time=clock.now) == 30
    recent.computed("unknown")  # a request another process placed


def test_a_burst_placed_just_before_a_heartbeat_counts_once():
    """Whether or not the heartbeat already holds the burst, its load is the burst's once."""
    clock = FakeClock()
    recent = RecentPlacements(clock)
    for i in range(6):
        recent.record("a", [], tokens=204, request_id=f"r{i}")
    clock.now += 0.2
    pulled = recent.load("a", heartbeat_pending=6 * 204, heartbeat_time=clock.now)
    not_yet = recent.load("a", heartbeat_pending=0, heartbeat_time=clock.now)
    assert pulled == not_yet == 6 * 204
    for i in range(6):
        recent.computed(f"r{i}")
    assert recent.load("a", heartbeat_pending=0, heartbeat_time=clock.now) == 0


def test_a_worker_that_evicted_a_prefix_stops_attracting_it():
    """Its published set no longer holds the prefix (and the recent memory has lapsed): the
    choice goes by load alone."""
    clock = FakeClock()
    recent = RecentPlacements(clock)
    hashes = prompt_hashes(list(range(1024)), BS)
    recent.record("a", hashes, tokens=1024)
    clock.now += RECENT_S + 1
    cands = [
        Candidate("a", recent.held_blocks("a", hashes, 0), 300),
        Candidate("b", recent.held_blocks("b", hashes, 0), 100),
    ]
    assert choose(cands, 1024, BS, 1.0).worker == "b"
    cands[0].held_blocks = recent.held_blocks("a", hashes, len(hashes))  # still held
    assert choose(cands, 1024, BS, 1.0).worker == "a"
