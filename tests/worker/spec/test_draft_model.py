"""A draft model's proposals in the engine: the same greedy tokens as without speculation
(batched, chunked, preempted, from the prefix cache), drafts both accepted and rejected, the
draft's cache given back, and a draft with another tokenizer refused by name. The draft is
the tiny target's own weights with noise (2% of each tensor's spread): it agrees with the
target on about half its tokens."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from llmq.common.model_files import load_tokenizer
from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.spec.config import SpecConfig
from llmq.worker.spec.draft_model import DraftRefused
from tests.worker.spec.test_spec_engine import GREEDY, SAMPLED, assert_same
from tests.worker.spec.test_spec_engine import run as run_without

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
    rng = random.Random(55)
    shared = [rng.randrange(3, 1024) for _ in range(40)]
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(3, 70))] for _ in range(6)]
    prompts += [shared + [rng.randrange(3, 1024) for _ in range(n)] for n in (2, 9)]
    return str(llama_dir), prompts, [rng.randint(12, 30) for _ in prompts]


def draft_engine(path, draft, **config) -> LLMEngine:
    spec = SpecConfig(method="draft", draft_model=str(draft), dtype="float32", device="cpu")
    spec.max_batch = 64  # every step drafts
    model = load_causal_lm(path, "float32", "cpu")
    return LLMEngine(
        model, EngineConfig(speculative=spec, **config), tokenizer=load_tokenizer(path)
    )


def run_with(engine, prompts, max_tokens, params, repeat=1):
    for r in range(repeat):
        ids = []
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            p = SamplingParams(max_tokens=n, seed=i, **params)
            ids.append(engine.add_request(f"{r}-{i}", prompt, p).request_id)
        tokens = {i: [] for i in ids}
        logprobs = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
                logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
            engine.block_manager.check_invariants(list(engine.requests.values()))
    assert engine.block_manager.num_used_blocks == 0
    assert engine.speculator.proposer.blocks.num_used_blocks == 0  # the draft's cache too
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


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
