"""Aborting requests: the KV blocks come back at once, the bookkeeping stays consistent, and the
requests left running still produce exactly ``model.generate``'s greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.sequence import FinishReason, SequenceStatus
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 2


@pytest.fixture(scope="module")
def reference(llama_dir):
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    cache: dict[tuple, list[int]] = {}

    def generate(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=n,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            cache[key] = out[0, len(prompt) :].tolist()
            assert len(cache[key]) == n
        return cache[key]

    return generate


def new_engine(llama_dir, **config) -> LLMEngine:
    config.setdefault("num_blocks", 64)
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    return LLMEngine(model, EngineConfig(**config), eos_token_ids={EOS})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


class Driver:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.results: dict[str, list[int]] = {}
        self.aborted: set[str] = set()

    def add(self, rid: str, prompt: list[int], n: int):
        self.results[rid] = []
        return self.engine.add_request(rid, prompt, greedy(n))

    def step(self) -> None:
        for out in self.engine.step():
            assert out.request_id not in self.aborted, "output for an aborted request"
            self.results[out.request_id].extend(out.token_ids)
        self.check()

    def check(self) -> None:
        self.engine.block_manager.check_invariants(list(self.engine.requests.values()))

    def abort(self, rid: str) -> None:
        engine, bm = self.engine, self.engine.block_manager
        seq = engine.requests[rid]
        blocks = list(seq.block_table)
        exclusive = [b for b in blocks if bm.blocks[b].ref_count == 1]
        shared = [b for b in blocks if bm.blocks[b].ref_count > 1]
        shared_refs = [bm.blocks[b].ref_count for b in shared]
        used, free = bm.num_used_blocks, bm.num_free_blocks
        out = engine.abort_request(rid)
        assert out is not None and out.request_id == rid
        assert out.finish_reason is FinishReason.ABORT and out.finished
        assert out.token_ids == []
        assert out.num_output_tokens == len(self.results[rid])
        assert seq.status is SequenceStatus.FINISHED and seq.block_table == []
        assert rid not in engine.requests
        # Freed at once: the used count drops by the blocks it alone held.
        assert bm.num_used_blocks == used - len(exclusive)
        assert bm.num_free_blocks == free + len(exclusive)
        assert all(bm.blocks[b].ref_count == 0 for b in exclusive)
        assert [bm.blocks[b].ref_count for b in shared] == [r - 1 for r in shared_refs]
        self.check()
        self.aborted.add(rid)

    def run(self, max_steps: int = 1000) -> None:
        n = 0
        while self.engine.has_unfinished():
            self.step()
            n += 1
            assert n < max_steps


def test_abort_running_request_frees_blocks_others_exact(llama_dir, reference):
    rng = random.Random(1)
    engine = new_engine(llama_dir)
    d = Driver(engine)
    prompts = {f"r{i}": rand_prompt(rng, n) for i, n in enumerate([40, 75, 23, 60, 90])}
    for rid, p in prompts.items():
        d.add(rid, p, 20)
    for _ in range(4):
        d.step()
    victim = engine.requests["r1"]
    assert victim.status is SequenceStatus.RUNNING and victim.num_output_tokens == 4
    assert len(victim.block_table) == engine.block_manager.blocks_needed(victim.num_tokens - 1)
    d.abort("r1")
    for _ in range(5):
        d.step()
    d.abort("r4")
    d.run()
    assert len(d.results["r1"]) == 4 and len(d.results["r4"]) == 9
    for rid in ("r0", "r2", "r3"):
        assert d.results[rid] == reference(prompts[rid], 20), rid
    # The partial outputs of the aborted ones were right as far as they went.
    assert d.results["r1"] == reference(prompts["r1"], 20)[:4]
    assert d.results["r4"] == reference(prompts["r4"], 20)[:9]
    assert engine.block_manager.num_used_blocks == 0
    # The id is free again; the request reuses the aborted one's cached prompt blocks (freed,
    # not erased) and runs to the exact output.
    d.aborted.discard("r1")
    again = d.add("r1", prompts["r1"], 12)
    d.step()
    assert again.num_cached_tokens == 64
    d.run()
    assert d.results["r1"] == reference(prompts["r1"], 12)


def test_abort_waiting_and_chunked_prefill(llama_dir, reference):
    rng = random.Random(2)
    engine = new_engine(llama_dir, max_batch_size=3, max_batch_tokens=32)
    d = Driver(engine)
    prompts = {
        "long": rand_prompt(rng, 150),
        "a": rand_prompt(rng, 10),
        "b": rand_prompt(rng, 12),
        "waiting": rand_prompt(rng, 20),
        "c": rand_prompt(rng, 5),
    }
    for rid, p in prompts.items():
        d.add(rid, p, 10)
    d.step()
    d.step()
    long = engine.requests["long"]
    assert 0 < long.num_computed_tokens < long.num_prompt_tokens  # mid-prefill
    assert engine.requests["waiting"].status is SequenceStatus.WAITING
    used = engine.block_manager.num_used_blocks
    d.abort("waiting")
    assert engine.block_manager.num_used_blocks == used
    # a and c, short, went ahead of long (scheduler._admit_short); b did not fit beside them.
    assert [s.request_id for s in engine.scheduler.waiting] == ["b"]
    d.abort("long")  # owned blocks for a partly computed prompt
    assert engine.block_manager.num_used_blocks < used
    d.run()
    assert d.results["long"] == [] and d.results["waiting"] == []
    for rid in ("a", "b", "c"):
        assert d.results[rid] == reference(prompts[rid], 10), rid
    assert engine.block_manager.num_used_blocks == 0


def test_abort_with_shared_prefix(llama_dir, reference):
    rng = random.Random(3)
    engine = new_engine(llama_dir)
    d = Driver(engine)
    shared = rand_prompt(rng, 64)
    first, second = shared + rand_prompt(rng, 10), shared + rand_prompt(rng, 20)
    d.add("first", first, 16)
    d.step()
    d.add("second", second, 16)
    d.step()
    s1, s2 = engine.requests["first"], engine.requests["second"]
    assert s2.num_cached_tokens == 64
    assert s1.block_table[:4] == s2.block_table[:4]
    bm = engine.block_manager
    assert all(bm.blocks[b].ref_count == 2 for b in s2.block_table[:4])
    d.step()
    d.abort("second")  # its shared blocks stay in use by "first"
    assert all(bm.blocks[b].ref_count == 1 for b in s1.block_table[:4])
    d.run()
    assert d.results["first"] == reference(first, 16)
    assert d.results["second"] == reference(second, 16)[:2]
    assert bm.num_used_blocks == 0


def test_abort_preempted_request(llama_dir, reference):
    rng = random.Random(4)
    engine = new_engine(llama_dir, num_blocks=10, max_batch_tokens=256)
    d = Driver(engine)
    prompts = {f"r{i}": rand_prompt(rng, 45) for i in range(3)}
    for rid, p in prompts.items():
        d.add(rid, p, 30)
    preempted = None
    for _ in range(40):
        d.step()
        preempted = next(
            (s for s in engine.requests.values() if s.num_preemptions and not s.block_table),
            None,
        )
        if preempted is not None:
            break
    assert preempted is not None, "no request was preempted"
    rid = preempted.request_id
    d.abort(rid)
    d.run()
    for other in prompts:
        if other != rid:
            assert d.results[other] == reference(prompts[other], 30), other
    assert engine.block_manager.num_used_blocks == 0


def test_abort_unknown_or_finished_returns_none(llama_dir):
    engine = new_engine(llama_dir)
    assert engine.abort_request("nope") is None
    engine.add_request("a", [5, 6, 7], greedy(2))
    assert engine.abort_request("a").finish_reason is FinishReason.ABORT
    assert engine.abort_request("a") is None  # twice
    engine.add_request("b", [5, 6, 7], greedy(2))
    while engine.has_unfinished():
        engine.step()
    assert engine.abort_request("b") is None  # already finished
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants([])
