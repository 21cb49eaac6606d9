"""The step cost fit and the drafts it lets pay: pure, no torch."""

from __future__ import annotations

import random

import pytest

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.scheduler import ScheduledSequence
from llmq.worker.engine.sequence import Sequence
from llmq.worker.spec.speculator import Speculator
from llmq.worker.spec.step_cost import StepCost

pytestmark = pytest.mark.unit


def test_fit_recovers_the_fixed_and_per_row_cost_through_noise():
    rng = random.Random(3)
    cost = StepCost()
    for _ in range(400):
        rows = rng.randrange(1, 40)
        cost.observe(rows, (0.020 + 0.0005 * rows) * rng.uniform(0.95, 1.05))
    assert cost.fixed == pytest.approx(0.020, rel=0.15)
    assert cost.per_row == pytest.approx(0.0005, rel=0.15)


def test_no_fit_without_spread_in_rows_and_a_fit_kept_once_rows_stop_varying():
    cost = StepCost()
    for _ in range(100):
        cost.observe(16, 0.03)
    assert cost.fixed is None and cost.least_acceptance(16) == 0.0  # unknown: every one drafts
    for rows in [1, 30] * 50:
        cost.observe(rows, 0.01 + 0.001 * rows)
    fitted = (cost.fixed, cost.per_row)
    for _ in range(500):  # only one row count from now on: the slope cannot be read
        cost.observe(30, 0.04)
    assert (cost.fixed, cost.per_row) == pytest.approx(fitted, rel=0.05)


def test_fit_follows_a_change_in_the_costs():
    cost = StepCost()
    for i in range(300):
        rows = 1 + i % 20
        cost.observe(rows, 0.02 + 0.001 * rows)
    for i in range(300):
        rows = 1 + i % 20
        cost.observe(rows, 0.01 + 0.002 * rows)
    assert cost.fixed == pytest.approx(0.01, rel=0.05)
    assert cost.per_row == pytest.approx(0.002, rel=0.05)


def test_the_least_acceptance_rises_with_the_batch():
    cost = StepCost(fixed=0.02, per_row=0.001)
    shares = [cost.least_acceptance(n) for n in (1, 4, 16, 64)]
    assert shares == sorted(shares) and shares[-1] < 1
    assert shares[2] == pytest.approx(0.016 / 0.036)


class Fixed:
    def propose(self, seqs, limits):
        return [[1] * k for k in limits]

    def forget(self, s):
        pass


def _decoding(rid: str) -> Sequence:
    s = Sequence(rid, [0] * 10, SamplingParams(max_tokens=500))
    s.num_computed_tokens = s.num_tokens - 1
    return s


def _check(spec: Speculator, s: Sequence, agree: int) -> None:
    draft, s.draft = s.draft, []
    item = ScheduledSequence(s, s.num_computed_tokens, 1 + len(draft), draft)
    spec.verify(item, [1] * agree + [2] * (len(draft) + 1 - agree))


def test_a_rarely_kept_draft_sits_out_large_batches_and_is_tried_again():
    spec = Speculator(Fixed(), num_tokens=4, max_batch=64, max_model_len=1000)
    spec.cost = StepCost(fixed=0.02, per_row=0.001)  # 8 rows: 0.286 kept at least
    often, seldom = _decoding("often"), _decoding("seldom")
    others = [_decoding(f"o{i}") for i in range(6)]
    spec.prepare([often, seldom])
    _check(spec, often, 4)
    _check(spec, seldom, 1)  # a quarter kept: pays with 2 decoding (0.091), not with 8
    spec.prepare([often, seldom])
    assert often.draft and seldom.draft
    _check(spec, often, len(often.draft))
    _check(spec, seldom, len(seldom.draft) // 4)
    spec.prepare([often, seldom, *others])
    assert often.draft and not seldom.draft
    often.draft = []
    for _ in range(10):  # left out, it drifts back toward all kept and drafts again
        spec.prepare([often, seldom, *others])
        often.draft = []
        if seldom.draft:
            break
    assert seldom.draft
