"""Prompt lookup's proposals and the speculator's bookkeeping: pure, no torch."""

from __future__ import annotations

import random

import pytest

from llmq.common.sampling_params import SamplingParams
from llmq.common.settings import Settings
from llmq.worker.engine.scheduler import ScheduledSequence
from llmq.worker.engine.sequence import Sequence
from llmq.worker.spec.config import SpecConfig
from llmq.worker.spec.ngram import NgramProposer
from llmq.worker.spec.speculator import Speculator, accepted_run

pytestmark = pytest.mark.unit


def seq(tokens, rid="r", **params) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(**params))


def scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What prompt lookup proposes, by a plain scan: the longest last n-gram's latest earlier
    occurrence, the k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def test_proposes_what_followed_the_latest_match():
    p = NgramProposer(1, 3)
    s = seq([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3])
    assert p.propose([s], [3]) == [[5, 7, 2]]  # "2 3" last seen before 5 7 2
    s.append_token(5)  # "2 3 5" matched whole: 7 2 3 5 follows
    assert p.propose([s], [4]) == [[7, 2, 3, 5]]
    assert p.propose([seq([1, 2, 3], "x")], [2]) == [[]]  # nothing repeats
    assert p.propose([s], [0]) == [[]]


def test_index_matches_a_plain_scan_as_tokens_arrive():
    rng = random.Random(7)
    p = NgramProposer(2, 4)
    s = seq([rng.randrange(4) for _ in range(5)])
    for _ in range(300):
        assert p.propose([s], [3]) == [scan(s.token_ids, 3, 2, 4)]
        s.append_token(rng.randrange(4))
    p.forget(s)
    fresh = seq(s.token_ids[:50])  # the same request id, another sequence: indexed anew
    assert p.propose([fresh], [3]) == [scan(fresh.token_ids, 3, 2, 4)]


def test_accepted_run():
    assert accepted_run([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted, then the bonus
    assert accepted_run([5, 8, 7], [5, 6]) == [5, 8]  # first mismatch: the target's token
    assert accepted_run([4, 6, 7], [5, 6]) == [4]


def test_speculator_limits_adapts_and_steps_aside():
    class Fixed:
        def propose(self, seqs, limits):
            return [[1] * k for k in limits]

        def forget(self, s):
            pass

    spec = Speculator(Fixed(), num_tokens=4, max_batch=2, max_model_len=100)
    a, b = seq([0] * 10, "a", max_tokens=3), seq([0] * 10, "b", speculative=False)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens - 1
    spec.prepare([a, b])
    assert a.draft == [1, 1] and b.draft == []  # room for 2 drafts and the target's token
    c, d = seq([0] * 97, "c"), seq([0] * 10, "d")
    for s in (c, d):
        s.num_computed_tokens = s.num_tokens - 1
    spec.prepare([c])
    assert c.draft == [1, 1]  # the context's end
    c.draft = []
    spec.prepare([a, c, d])  # three decoding: more than max_batch
    assert c.draft == [] and d.draft == []


def test_draft_length_follows_acceptance_and_misses_sit_out():
    class Fixed:
        def propose(self, seqs, limits):
            return [[1] * k for k in limits]

        def forget(self, s):
            pass

    spec = Speculator(Fixed(), num_tokens=4, max_batch=8, max_model_len=1000)
    s = seq([0] * 10, "a", max_tokens=500)
    s.num_computed_tokens = s.num_tokens - 1

    def step(agree: int) -> list[int]:
        """One step whose draws agree with the first ``agree`` drafts; the draft it checked."""
        spec.prepare([s])
        draft, s.draft = s.draft, []
        if draft:
            item = ScheduledSequence(s, s.num_computed_tokens, 1 + len(draft), draft)
            spec.verify(item, [1] * agree + [2] * (len(draft) + 1 - agree))
        return draft

    assert len(step(4)) == 4  # all kept: stays at the most
    assert len(step(1)) == 4
    assert len(step(0)) == 2  # one past what was kept
    assert len(step(0)) == 1  # rejected whole twice: sits out two steps
    assert step(0) == [] and step(0) == []
    assert len(step(1)) == 1
    assert len(step(1)) == 2  # all kept: doubled


def test_default_cap_bounds_the_doubled_draft_length():
    class Fixed:
        def propose(self, seqs, limits):
            return [[1] * k for k in limits]

        def forget(self, s):
            pass

    cap = SpecConfig().num_tokens
    assert cap == Settings().speculative_tokens == 6
    spec = Speculator(Fixed(), num_tokens=cap, max_batch=8, max_model_len=1000)
    s = seq([0] * 10, "a", max_tokens=500)
    s.num_computed_tokens = s.num_tokens - 1
    lengths = []
    for agree in (0, 1, 2, 4, 6, 6):  # a miss, then each draft kept whole
        spec.prepare([s])
        draft, s.draft = s.draft, []
        lengths.append(len(draft))
        item = ScheduledSequence(s, s.num_computed_tokens, 1 + len(draft), draft)
        spec.verify(item, [1] * agree + [2] * (len(draft) + 1 - agree))
    assert lengths == [6, 1, 2, 4, 6, 6]  # doubled while kept, never past the cap
