"""A draft model's proposals in the engine: the same greedy tokens as without speculation
(batched, chunked, preempted, from the prefix cache), drafts both accepted and rejected, the
draft's cache given back, and a draft with another tokenizer refused by name. The draft is
the tiny target's own weights with noise (2% of each tensor's spread): it agrees with the
target on about half its tokens."""

from __future__ import annotations

import json
import shutil

import pytest

from llmq.worker.llm_engine import LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.spec.draft_model import DraftRefused
from tests.worker.spec.engines import (
    GREEDY,
    SAMPLED,
    assert_same,
    build,
    drive,
    prompts_and_lengths,
)
from tests.worker.spec.engines import run as run_without

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def draft_dir(llama_dir, tmp_path_factory):
    import torch

    path = tmp_path_factory.mktemp("draft")
    shutil.copytree(llama_dir, path, dirs_exist_ok=True)
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std())
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def case(llama_dir):
    return str(llama_dir), *prompts_and_lengths()


def draft_engine(path, draft, **config) -> LLMEngine:
    return build(path, draft=draft, **config)


def run_with(engine, prompts, max_tokens, params, repeat=1):
    tokens_and_logprobs = drive(engine, prompts, max_tokens, params, repeat)
    assert engine.speculator.proposer.blocks.num_used_blocks == 0  # the draft's cache too
    return tokens_and_logprobs


@pytest.mark.parametrize(
    "config, params",
    [
        ({}, GREEDY),
        ({}, SAMPLED),
        ({"num_blocks": 10}, GREEDY),  # preempted and recomputed
        ({"max_batch_tokens": 16, "max_batch_size": 4}, GREEDY),  # chunked prefill
    ],
    ids=["batched", "seeded-sampling", "preempted", "chunked"],
)
def test_same_output_with_a_draft_model(case, draft_dir, config, params):
    path, prompts, max_tokens = case
    base = run_without(path, prompts, max_tokens, params, **config)[:2]
    engine = draft_engine(path, draft_dir, **config)
    assert_same(base, run_with(engine, prompts, max_tokens, params), engine)
    if "num_blocks" in config:
        assert engine.scheduler.num_preemptions > 0


def test_same_output_from_the_prefix_cache(case, draft_dir):
    """Prompts sent twice: the target starts the second round from its prefix cache, the
    draft computes its own cache again."""
    path, prompts, max_tokens = case
    base = run_without(path, prompts, max_tokens, GREEDY)[:2]
    engine = draft_engine(path, draft_dir)
    spec = run_with(engine, prompts, max_tokens, GREEDY, repeat=2)
    assert_same(base, spec, engine)
    assert engine.block_manager.prefix_hits > sum(len(p) for p in prompts) // 2


def test_a_draft_with_another_tokenizer_is_refused(llama_dir, draft_dir, tmp_path):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(draft_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DraftRefused, match=f"draft model {other} has another tokenizer"):
        draft_engine(str(llama_dir), other)


def test_the_draft_cache_follows_the_kept_tokens(case, llama_dir):
    """The target drafting for itself: every draft is what it then generates, so all are kept,
    unless the draft's cache held a rejected token, missed a kept one or lagged behind a
    preemption or a chunked prompt (its numerics differ only by the batch's layout)."""
    path, prompts, max_tokens = case
    engine = draft_engine(path, llama_dir, num_blocks=10, max_batch_tokens=16)
    run_with(engine, prompts, max_tokens, GREEDY)
    stats = engine.speculator.stats
    assert engine.scheduler.num_preemptions > 0
    assert stats.proposed > 40 and stats.accepted >= 0.97 * stats.proposed, stats
