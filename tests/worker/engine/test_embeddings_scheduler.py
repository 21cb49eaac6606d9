"""The embeddings scheduler and backend, pure: batch bounds, exactly-once, no starvation,
length grouping, the padding floor, and answers in input order."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
import torch

from llmq.worker.engine.embeddings import EmbeddingsScheduler

pytestmark = pytest.mark.unit

# ---- 4. the scheduler (pure) --------------------------------------------------------------


def drain(sched: EmbeddingsScheduler, arrivals: list[list[tuple[str, int, int]]]):
    """Feed arrivals one burst per step; schedule until nothing waits. Checks, on every batch,
    the bounds and that the oldest waiting input is in it. Returns the batches."""
    batches = []
    pending = list(arrivals)
    while pending or sched.num_waiting:
        if pending:
            for rid, index, length in pending.pop(0):
                sched.add(rid, index, length)
        if not sched.num_waiting:
            continue
        oldest = sched.waiting[0]
        batch = sched.schedule()
        assert batch, "nothing scheduled while inputs wait"
        assert oldest in batch, "the oldest waiting input was left out"
        assert len(batch) <= sched.max_batch_size
        padded = max(it.length for it in batch) * len(batch)
        assert padded <= sched.max_batch_tokens
        if len(batch) > 1:  # one input alone has no padding
            assert sum(it.length for it in batch) >= sched.min_efficiency * padded
        batches.append(batch)
    return batches


def random_arrivals(rng: random.Random, max_len: int) -> list[list[tuple[str, int, int]]]:
    arrivals = []
    for r in range(rng.randint(1, 12)):
        burst = []
        for q in range(rng.randint(0, 3)):
            rid = f"r{r}-{q}"
            burst += [(rid, i, rng.randint(1, max_len)) for i in range(rng.randint(1, 70))]
        arrivals.append(burst)
    return arrivals


def test_scheduler_bounds_and_exactly_once():
    for seed in range(60):
        rng = random.Random(seed)
        max_len = rng.choice([16, 64, 256])
        size = rng.choice([1, 2, 7, 32, 64])
        tokens = rng.choice([max_len, max_len * 3, 2048, 8192])
        sched = EmbeddingsScheduler(
            size,
            tokens,
            window_batches=rng.choice([1, 2, 4]),
            min_efficiency=rng.choice([0.0, 0.0, 0.5, 0.75, 0.95]),
        )
        arrivals = random_arrivals(rng, max_len)
        batches = drain(sched, arrivals)
        scheduled = [(it.request_id, it.index) for b in batches for it in b]
        wanted = [(rid, i) for burst in arrivals for rid, i, _ in burst]
        assert len(scheduled) == len(set(scheduled)), f"seed {seed}: an input ran twice"
        assert sorted(scheduled) == sorted(wanted), f"seed {seed}: an input was lost"


def test_scheduler_never_starves_a_long_input():
    sched = EmbeddingsScheduler(max_batch_size=8, max_batch_tokens=8 * 256, window_batches=4)
    sched.add("long", 0, 250)
    # Short inputs keep arriving, more than fit in a batch each time.
    arrivals = [[(f"s{r}", i, 5) for i in range(12)] for r in range(20)]
    batches = drain(sched, arrivals)
    assert any(it.request_id == "long" for it in batches[0])


def test_scheduler_remove_drops_a_request():
    sched = EmbeddingsScheduler(max_batch_size=4, max_batch_tokens=1024)
    for rid in ("a", "b", "c"):
        for i in range(5):
            sched.add(rid, i, 10 + i)
    sched.remove("b")
    assert sched.num_waiting == 10
    seen = [it.request_id for b in drain(sched, []) for it in b]
    assert "b" not in seen and len(seen) == 10


def padded(batches) -> int:
    return sum(max(it.length for it in b) * len(b) for b in batches)


def test_scheduler_groups_similar_lengths():
    rng = random.Random(7)
    size = 32
    waste = {"sorted": 0, "fifo": 0}
    for trial in range(5):
        items = [
            (f"r{trial}-{i // 32}", i % 32, rng.choice([rng.randint(3, 20), rng.randint(20, 200)]))
            for i in range(size * 16)
        ]
        real = sum(length for _, _, length in items)
        sched = EmbeddingsScheduler(size, size * 256)
        for it in items:
            sched.add(*it)
        batches = drain(sched, [])
        fifo = [items[i : i + size] for i in range(0, len(items), size)]
        waste["sorted"] += padded(batches) - real
        waste["fifo"] += sum(max(x[2] for x in b) * len(b) for b in fifo) - real
    assert waste["sorted"] < 0.5 * waste["fifo"], waste


def closed_loop(sched: EmbeddingsScheduler, lengths: list[int], in_flight: int, per_request: int):
    """Clients keep ``in_flight`` requests of ``per_request`` inputs waiting, sending the next
    one when one is answered; returns the batches."""
    requests = [lengths[i : i + per_request] for i in range(0, len(lengths), per_request)]
    left: dict[str, int] = {}
    batches = []

    def send(n):
        if n < len(requests):
            for i, length in enumerate(requests[n]):
                sched.add(str(n), i, length)
            left[str(n)] = len(requests[n])

    for n in range(in_flight):
        send(n)
    sent = in_flight
    while sched.num_waiting:
        batch = sched.schedule()
        batches.append(batch)
        for it in batch:
            left[it.request_id] -= 1
            if left[it.request_id] == 0:
                send(sent)
                sent += 1
    assert sum(map(len, batches)) == len(lengths)
    return batches


def test_scheduler_efficiency_floor_cuts_padding_with_few_requests_in_flight():
    """Four requests of 32 in flight and batches of up to 64: without a floor a batch spans
    every length in flight and pads almost as much as input-order batches of 32."""
    rng = random.Random(11)
    lengths = [min(60, max(3, int(rng.lognormvariate(2.6, 0.5)))) for _ in range(2048)]
    fifo = sum(max(lengths[i : i + 32]) * 32 for i in range(0, len(lengths), 32))
    wide = padded(closed_loop(EmbeddingsScheduler(64, 8192), lengths, 4, 32))
    tight_batches = closed_loop(EmbeddingsScheduler(64, 8192, min_efficiency=0.75), lengths, 4, 32)
    tight = padded(tight_batches)
    assert tight < 0.75 * wide and tight < 0.7 * fifo, (tight, wide, fifo)
    assert len(tight_batches) < len(lengths) / 8  # still batches, not single inputs


def test_backend_sets_the_efficiency_floor_on_cpu_only():
    from llmq.worker.backends import EmbeddingBackend

    cpu, gpu = FakeRunner(), FakeRunner()
    cpu.device, gpu.device = torch.device("cpu"), torch.device("meta")
    assert EmbeddingBackend(cpu, 64, 8192, 256).scheduler.min_efficiency > 0
    assert EmbeddingBackend(gpu, 64, 8192, 256).scheduler.min_efficiency == 0


def test_scheduler_batch_tokens_cut_batches_of_long_inputs():
    sched = EmbeddingsScheduler(max_batch_size=64, max_batch_tokens=1024)
    for i in range(64):
        sched.add("r", i, 200)
    batch = sched.schedule()
    assert len(batch) == 5  # 5 * 200 <= 1024 < 6 * 200


class FakeRunner:
    """Vector of an input: [its first token id, its length, 0, ...]."""

    vocab_size = 1000
    dimensions = 4
    matryoshka = False

    def __init__(self):
        self.batches: list[list[list[int]]] = []

    def embed(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        self.batches.append(inputs)
        return [torch.tensor([ids[0], len(ids), 0.0, 0.0]) for ids in inputs]


def test_backend_answers_each_request_in_input_order():
    from llmq.common.protocol import EngineRequest
    from llmq.worker.backends import EmbeddingBackend

    runner = FakeRunner()
    backend = EmbeddingBackend(runner, max_batch_size=8, max_batch_tokens=64, max_model_len=32)
    rng = random.Random(0)
    wanted = {}
    for r in range(6):
        inputs = [[rng.randrange(1, 1000)] * rng.randint(1, 32) for _ in range(rng.randint(1, 20))]
        wanted[f"r{r}"] = inputs
        backend.add(EngineRequest(f"r{r}", [], kind="embed", inputs=inputs), [])
    backend.add(EngineRequest("gone", [], kind="embed", inputs=[[5, 5]] * 30), [])
    assert backend.abort("gone").finish_reason == "abort"
    done = {}
    while backend.has_unfinished():
        for rid, msg in backend.step():
            done[rid] = msg
    assert set(done) == set(wanted)
    for rid, inputs in wanted.items():
        msg = done[rid]
        got = [np.frombuffer(base64.b64decode(v), dtype="<f4") for v in msg.embeddings]
        assert [(int(v[0]), int(v[1])) for v in got] == [(ids[0], len(ids)) for ids in inputs]
        assert msg.usage["prompt_tokens"] == sum(map(len, inputs))
    assert all(len(b) <= 8 and max(map(len, b)) * len(b) <= 64 for b in runner.batches)
    assert not any(b == [5, 5] for batch in runner.batches for b in batch)


def test_backend_refuses_what_it_cannot_run():
    from llmq.common.protocol import EngineRequest
    from llmq.worker.backends import EmbeddingBackend
    from llmq.worker.llm_engine import RequestError

    backend = EmbeddingBackend(
        FakeRunner(), max_batch_size=8, max_batch_tokens=64, max_model_len=32
    )
    for bad in (
        EngineRequest("a", [1, 2]),  # a generation request
        EngineRequest("b", [], kind="embed", inputs=[]),
        EngineRequest("c", [], kind="embed", inputs=[[1], []]),
        EngineRequest("d", [], kind="embed", inputs=[[1] * 33]),
        EngineRequest("e", [], kind="embed", inputs=[[1000]]),
        EngineRequest("f", [], kind="embed", inputs=[[1]], options={"dimensions": 5}),
    ):
        with pytest.raises(RequestError):
            backend.add(bad, [])
    assert not backend.has_unfinished()
