"""Suffix decoding: the most frequent continuation of the longest match, as long as the match
(pure, on hand-made token lists); lossless in the engine; a request sent again after it
finished is proposed its first run's output, so more of its drafts are kept."""

from __future__ import annotations

import pytest

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.sequence import Sequence
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.spec.config import SpecConfig
from llmq.worker.spec.suffix import SuffixProposer
from tests.worker.spec.test_spec_engine import GREEDY, assert_same, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def propose(proposer, tokens, k=8, rid="r", prompt=1):
    seq = Sequence(rid, tokens[:prompt], output_token_ids=tokens[prompt:])
    return proposer.propose([seq], [k])[0], seq


def test_the_most_frequent_continuation_of_the_longest_match():
    p = SuffixProposer()
    # after (1, 2): 3 3 once, 4 4 twice; after (9, 1, 2): 5 5
    ctx = [1, 2, 3, 3, 0, 1, 2, 4, 4, 0, 1, 2, 4, 4, 0, 9, 1, 2, 5, 5, 0, 7, 1, 2]
    assert propose(p, ctx)[0] == [4, 4]  # two tokens: the match is two long
    assert propose(p, ctx + [0, 8, 9, 1, 2], rid="s")[0] == [5, 5, 0]  # matched three long
    assert propose(p, [1, 2, 3], rid="t")[0] == []  # no earlier occurrence


def test_a_finished_request_output_is_proposed_to_the_next():
    p = SuffixProposer(max_requests=2)
    prompt = [5, 6, 7, 8]
    done = Sequence("a", prompt, output_token_ids=[10, 11, 12, 13, 14, 15, 16])
    p.forget(done)
    assert propose(p, [*prompt, 10, 11], prompt=4, rid="b")[0] == [12, 13, 14, 15, 16]
    for i in range(3):  # two kept at most: the oldest goes first
        p.forget(Sequence(f"x{i}", [50 + i], output_token_ids=[60 + i, 61 + i, 62 + i]))
    assert p.num_kept == 2
    assert propose(p, [*prompt, 10, 11], prompt=4, rid="c")[0] == []


def test_suffix_decoding_in_the_engine(llama_dir):
    """Outputs that repeat themselves (a negative frequency penalty): the same tokens."""
    import random

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    params = dict(GREEDY, frequency_penalty=-0.5)
    base = run(str(llama_dir), prompts, [60] * 4, params)
    spec = run(str(llama_dir), prompts, [60] * 4, params, SuffixProposer())
    assert_same(base[:2], spec[:2], spec[2])


def test_the_same_request_again_keeps_more_drafts(llama_dir):
    """The second run of a request finds the first run's output: more of its drafts are
    kept, and its output is the same."""
    spec = SpecConfig(method="suffix", max_batch=64)
    engine = LLMEngine(
        load_causal_lm(str(llama_dir), "float32", "cpu"), EngineConfig(speculative=spec)
    )
    prompt = [17, 300, 42, 999, 7, 123, 512, 64, 33, 801]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=60)
    stats = engine.speculator.stats
    first = engine.generate([prompt], params)
    accepted, proposed = stats.accepted, stats.proposed
    second = engine.generate([prompt], params)
    assert second == first
    assert stats.accepted - accepted > max(2 * accepted, 30), stats
    assert stats.accepted - accepted >= 0.9 * (stats.proposed - proposed), stats
