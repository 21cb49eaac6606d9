"""The adapter pool: adapters load on its thread (a slow load holds back only the sequences
that wait for it), at most ``max_loras`` stay loaded, the least recently used unused one goes
first, a load waits while every loaded adapter is in use, and a failed load fails only the
sequences waiting for it. The loader is an in-memory stand-in for reading folders."""

from __future__ import annotations

import threading

import pytest

from llmq.worker.engine.sequence import LoraRef, Sequence
from llmq.worker.lora_pool import LoraPool
from llmq.worker.runner.lora.lora_weights import AdapterWeights, LoraLoadError

pytestmark = pytest.mark.unit


class Loader:
    """Loads an adapter per folder; ``gates`` hold a folder's load until set; folders in
    ``broken`` fail."""

    def __init__(self, broken=()):
        self.loads: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.broken = set(broken)

    def __call__(self, ref: LoraRef) -> AdapterWeights:
        gate = self.gates.get(ref.path)
        if gate is not None:
            assert gate.wait(5)
        self.loads.append(ref.path)
        if ref.path in self.broken:
            raise LoraLoadError(f"{ref.path} has no adapter_config.json")
        return AdapterWeights(8, 1.0)


def _seq(rid: str, name: str, path: str | None = None) -> Sequence:
    return Sequence(rid, [1, 2, 3], lora=LoraRef(name, path or f"/a/{name}"))


def _settle(pool: LoraPool):
    """Wait for the loads under way; what ``ready`` then hands back."""
    ready, failed = [], []
    for _ in range(50):
        pool.wait(0.1)
        r, f = pool.ready()
        ready += r
        failed += f
        if not pool._loading:
            return ready, failed
    raise AssertionError("loads did not finish")


def test_a_sequence_waits_for_its_adapter_then_runs():
    loader = Loader()
    pool = LoraPool(loader, max_loras=2)
    a1, a2 = _seq("1", "a"), _seq("2", "a")
    assert not pool.add(a1) and not pool.add(a2)
    ready, failed = _settle(pool)
    assert ready == [a1, a2] and not failed and loader.loads == ["/a/a"]
    assert pool.add(_seq("3", "a"))  # loaded: runs at once
    assert pool.names() == "a"


def test_a_slow_load_holds_back_only_its_own_sequences():
    loader = Loader()
    loader.gates["/a/slow"] = threading.Event()
    pool = LoraPool(loader, max_loras=4)
    slow, fast = _seq("s", "slow"), _seq("f", "fast")
    pool.add(slow)
    pool.add(fast)
    assert pool.ready() == ([], [])  # neither load done yet: nothing blocks the caller
    loader.gates["/a/slow"].set()
    ready, _ = _settle(pool)
    assert set(ready) == {slow, fast}


def test_the_least_recently_used_unused_adapter_goes_first():
    loader = Loader()
    pool = LoraPool(loader, max_loras=2)
    a, b = _seq("a", "a"), _seq("b", "b")
    pool.add(a)
    pool.add(b)
    _settle(pool)
    pool.add(_seq("a2", "a"))  # a used again: b is now the least recent
    for seq in (a, b):
        pool.release(seq)
    pool.release(_seq("a2", "a"))
    c = _seq("c", "c")
    pool.add(c)
    ready, _ = _settle(pool)
    assert ready == [c] and set(pool.resident) == {a.lora, c.lora}
    # b again: read from disk again, in the place of a (now the least recent, unused).
    pool.release(c)
    pool.add(_seq("b2", "b"))
    _settle(pool)
    assert loader.loads == ["/a/a", "/a/b", "/a/c", "/a/b"]
    assert set(pool.resident) == {c.lora, b.lora}


def test_a_load_waits_while_every_loaded_adapter_is_in_use():
    pool = LoraPool(Loader(), max_loras=1)
    a, b = _seq("a", "a"), _seq("b", "b")
    pool.add(a)
    _settle(pool)
    assert not pool.add(b)
    assert _settle(pool) == ([], []) and list(pool.resident) == [a.lora]
    pool.release(a)
    ready, _ = _settle(pool)
    assert ready == [b] and list(pool.resident) == [b.lora]


def test_the_same_name_from_another_folder_is_another_adapter():
    loader = Loader()
    pool = LoraPool(loader, max_loras=4)
    old, new = _seq("1", "x", "/v1"), _seq("2", "x", "/v2")
    pool.add(old)
    pool.add(new)
    ready, _ = _settle(pool)
    assert set(ready) == {old, new} and sorted(loader.loads) == ["/v1", "/v2"]
    assert len(pool.resident) == 2 and pool.names() == "x"


def test_a_failed_load_fails_only_its_sequences():
    pool = LoraPool(Loader(broken={"/a/bad"}), max_loras=2)
    bad1, bad2, good = _seq("1", "bad"), _seq("2", "bad"), _seq("3", "good")
    for seq in (bad1, good, bad2):
        pool.add(seq)
    ready, failed = _settle(pool)
    assert ready == [good]
    assert [s for s, _ in failed] == [bad1, bad2]
    assert all("'bad' could not be loaded" in e and "adapter_config" in e for _, e in failed)
    assert list(pool.resident) == [good.lora]
    for seq in (bad1, bad2):
        assert not pool.release(seq)  # no longer waiting
    assert dict(pool._users) == {good.lora: 1}


def test_a_released_waiting_sequence_leaves_the_queue():
    loader = Loader()
    loader.gates["/a/a"] = threading.Event()
    pool = LoraPool(loader, max_loras=1)
    seq = _seq("1", "a")
    pool.add(seq)
    assert pool.busy and pool.release(seq) and not pool.busy
    loader.gates["/a/a"].set()
    pool.close()
