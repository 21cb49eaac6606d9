"""Runs of prompt positions that attend to each other both ways (a Gemma 3 image's tokens):
the scheduler never ends a prefill chunk inside one (a run it starts in is taken whole, beyond
the prompt budget beside decodes, or waits), and a chunk's masks let a run's queries see its
later keys, under a sliding window too, as transformers' OR of causal and same-image, AND the
window."""

from __future__ import annotations

import pytest
import torch

from llmq.worker.engine.scheduler import ScheduledSequence
from llmq.worker.request_error import RequestError
from llmq.worker.runner.attention.step_metadata import StepBuilder
from llmq.worker.vision.gemma3 import bidirectional_runs
from llmq.worker.vision.runtime import ImageSpan
from tests.engine_sequences import make_seq, prefix
from tests.worker.engine.test_scheduler import make_sched, run_step

pytestmark = pytest.mark.unit


def chunks(sched, seq, steps: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(steps):
        step, _ = run_step(sched)
        out += [(i.start, i.num_new_tokens) for i in step.scheduled if i.seq is seq]
    return out


def test_a_chunk_never_ends_inside_a_run():
    sched = make_sched(max_batch_tokens=24)
    seq = make_seq("a", prefix(60), max_tokens=1)
    seq.bidirectional = [(17, 33), (40, 50)]
    sched.add(seq)
    # 0..24 would cut the first run: back to its start; 17..41 the second: back to 40.
    assert chunks(sched, seq, 3) == [(0, 17), (17, 23), (40, 20)]


@pytest.mark.parametrize(
    ("run", "expected"), [((4, 20), [(0, 4), (4, 16), (20, 8)]), ((2, 30), [(0, 2)])]
)
def test_a_run_beside_decodes_is_taken_whole_or_waits(run, expected):
    """8 prompt tokens beside a decode would cut the run: it is taken whole where the step
    holds it (23 tokens left beside the decode), else it waits."""
    sched = make_sched(max_batch_tokens=24, max_prefill_tokens_with_decodes=8)
    sched.add(make_seq("d", prefix(4, 500), max_tokens=20))
    run_step(sched)
    seq = make_seq("a", prefix(40), max_tokens=1)
    seq.bidirectional = [run]
    sched.add(seq)
    assert chunks(sched, seq, 3) == expected


def test_runs_join_adjacent_spans_and_refuse_one_longer_than_a_step():
    spans = [ImageSpan("a", 3, 4), ImageSpan("b", 7, 2), ImageSpan("c", 12, 4)]
    assert bidirectional_runs(spans, 8) == [(3, 9), (12, 16)]
    with pytest.raises(RequestError, match="LLMQ_MAX_BATCH_TOKENS is 5"):
        bidirectional_runs(spans, 5)


def visible(q: int, k: int, runs, window) -> bool:
    """transformers' Gemma 3 rule: (causal OR same run) AND inside the window."""
    same = any(a <= q < b and a <= k < b for a, b in runs)
    return (k <= q or same) and (window is None or k > q - window)


@pytest.mark.parametrize("start", [0, 5, 12])
def test_a_chunks_masks_open_its_runs_both_ways(start):
    window, ctx = 4, 20
    builder = StepBuilder(None, torch.float32, torch.device("cpu"), 16, frozenset({window}),
                          True, 64, 0, None)  # fmt: skip
    seq = make_seq("a", prefix(ctx))
    seq.block_table = [0, 1]
    seq.bidirectional = [(3, 11), (13, 19)]
    item = ScheduledSequence(seq, start, ctx - start)
    runs = [(a, b) for a, b in seq.bidirectional if a < ctx and b > start]
    chunk = builder.prefill_chunk(item, 0, runs)
    for mask, w in ((chunk.mask, None), (chunk.window_masks[window], window)):
        got = (mask == 0).tolist()
        want = [[visible(q, k, runs, w) for k in range(ctx)] for q in range(start, ctx)]
        assert got == want
