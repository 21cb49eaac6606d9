"""Speculation samples from the target's distribution: the first two tokens after a context,
drawn 6,000 times by the sampler with a two-token draft and the speculator's acceptance rule
(and the next step's draw where the first draft is rejected), follow the tiny random model's own
joint distribution by a chi-square test; two broken acceptance rules, each a classic mistake,
fail the same test."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.sequence import Sequence
from llmq.worker.runner.sampler import Sampler
from llmq.worker.spec.speculator import DraftRow, accepted_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 6_000
PARAMS = SamplingParams(temperature=1.0, top_k=5, ignore_eos=True)
CONTEXT = [5, 77, 300, 12, 901, 44, 8, 613]


def keep_all_draws(sampled: list[int], draft: list[int]) -> list[int]:
    """Broken: every position's draw kept, though those after a mismatch were drawn after a
    draft token that is not in the output."""
    return sampled


def resample_from_target(sampled: list[int], draft: list[int]) -> list[int]:
    """Broken: a rejected draft replaced by a fresh draw from the target's distribution (the
    last row's) instead of one from the residual, which may draw the draft token again."""
    if sampled[0] != draft[0]:
        return [sampled[-1]]
    return accepted_run(sampled, draft)


@pytest.fixture(scope="module")
def target(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    sampler = Sampler()

    @torch.inference_mode()
    def logits(tokens: list[int]) -> torch.Tensor:
        return model(torch.tensor([tokens])).logits[0].float()

    def probs(row: torch.Tensor) -> torch.Tensor:
        top = row.topk(PARAMS.top_k)
        p = torch.zeros_like(row)
        p[top.indices] = torch.softmax(top.values, dim=-1)
        return p

    return logits, probs, sampler


def joint_counts(target, rule) -> tuple[dict, dict, int]:
    """Sampled and exact P(x0, x1), and how often the first draft was accepted."""
    logits, probs, sampler = target
    seq = Sequence("r", CONTEXT, PARAMS)
    base = logits(CONTEXT)[-1]
    p0 = probs(base)
    draft = [int(p0.topk(2).indices[1])]  # the second most likely: accepted at times
    draft.append(int(probs(logits(CONTEXT + draft)[-1]).argmax()))
    rows_logits = logits(CONTEXT + draft)[-3:]
    # the three positions' rows, and a second draw of the first for a broken rule
    rows_logits = torch.cat([rows_logits, rows_logits[:1]])
    rows = [seq, DraftRow(seq, draft[:1]), DraftRow(seq, draft), seq]
    torch.manual_seed(0)
    drawn = sampler(rows_logits.repeat(N, 1), rows * N).token_ids
    support = p0.nonzero()[:, 0].tolist()
    after = {x: logits(CONTEXT + [x])[-1] for x in support}
    exact = {(x, y): float(p0[x] * probs(after[x])[y]) for x in support for y in range(len(p0))}
    exact = {k: v for k, v in exact.items() if v > 0}
    firsts: list[int] = []
    pairs = []
    for i in range(N):
        run = rule(drawn[4 * i : 4 * i + 4], draft)
        if len(run) >= 2:
            pairs.append((run[0], run[1]))
        else:
            firsts.append(run[0])
    # where only the first token came out, the next step draws the second after it
    for x in set(firsts):
        rows_x = [DraftRow(seq, [x])] * firsts.count(x)
        second = sampler(after[x].repeat(len(rows_x), 1), rows_x).token_ids
        pairs += [(x, y) for y in second]
    counts: dict = {}
    for pair in pairs:
        counts[pair] = counts.get(pair, 0) + 1
    accepted = sum(1 for i in range(N) if drawn[4 * i] == draft[0])
    return counts, exact, accepted


def chi_square_passes(counts: dict, exact: dict) -> bool:
    """Pearson's test of ``counts`` against ``exact`` (cells expected < 5 times pooled), at a
    one-in-a-million false alarm (Wilson-Hilferty's chi-square quantile)."""
    if set(counts) - set(exact):
        return False  # a pair the target never draws
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in exact.items():
        expected, observed = p * N, counts.get(cell, 0)
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + observed, pooled_exp + expected
            continue
        stat += (observed - expected) ** 2 / expected
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    df = cells - 1
    z = 4.75  # the standard normal's 1 - 1e-6 quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def test_speculative_sampling_follows_the_target(target):
    counts, exact, accepted = joint_counts(target, accepted_run)
    assert 0.05 * N < accepted < 0.95 * N  # the draft was accepted at times, rejected at others
    assert chi_square_passes(counts, exact)


@pytest.mark.parametrize("rule", [keep_all_draws, resample_from_target])
def test_broken_acceptance_rules_fail(target, rule):
    counts, exact, _ = joint_counts(target, rule)
    assert not chi_square_passes(counts, exact)
