"""The sampler's logprobs: the top-k sorted and the chosen token's from the raw logits, and the
engine's equal to the reference model's."""

from __future__ import annotations

import pytest
import torch

from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner.sampler import Sampler
from tests.worker.runner.test_sampler import EOS, seq_with

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs_top_k_sorted_and_chosen_from_raw_logits():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 200, generator=gen) * 2
    raw = logits.clone()
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=3),
        SamplingParams(temperature=1.0, repetition_penalty=1.5, logprobs=1),
        SamplingParams(temperature=1.3, top_k=20, presence_penalty=1.0, logprobs=0),
        SamplingParams(temperature=1.0, logprobs=None),
        SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=8),
        SamplingParams(temperature=0.5, min_p=0.2, logprobs=2, seed=3),
        SamplingParams(temperature=2.0, logprobs=20),
    ]
    seqs = [
        seq_with(p, prompt=[3, 4], output=[int(raw[i].argmax()), 9]) for i, p in enumerate(params)
    ]
    out = Sampler()(logits, seqs)
    assert torch.equal(logits, raw)
    expected = torch.log_softmax(raw.double(), dim=-1)
    for i, p in enumerate(params):
        lp = out.logprobs[i]
        if p.logprobs is None:
            assert lp is None
            continue
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(expected[i, token]), abs=1e-5)
        assert len(lp.top) == p.logprobs
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        want = expected[i].topk(p.logprobs)
        assert [t for t, _ in lp.top] == want.indices.tolist()
        assert values == pytest.approx(want.values.tolist(), abs=1e-5)
    # Penalties changed the greedy choice of row 5 away from the raw argmax it repeats,
    # yet its logprob is still that of the raw logits.
    assert out.token_ids[5] != int(raw[5].argmax())
    assert out.logprobs[5].logprob < out.logprobs[5].top[0][1]


def test_engine_logprobs_match_the_reference_model(llama_dir):
    path = str(llama_dir)
    reference = load_causal_lm(path, "float32", "cpu")
    engine = LLMEngine(load_causal_lm(path, "float32", "cpu"), EngineConfig(num_blocks=64), {EOS})
    prompt = [5, 88, 402, 17, 999, 250, 31]
    engine.add_request(
        "a", prompt, SamplingParams(temperature=0.8, seed=2, max_tokens=8, logprobs=4)
    )
    engine.add_request("b", [9, 9, 9, 100], SamplingParams(temperature=0, max_tokens=5))
    entries = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "a":
                assert out.logprobs is not None and len(out.logprobs) == 1
                assert out.logprobs[0].token_id == out.token_ids[0]
                entries.append(out.logprobs[0])
            else:
                assert out.logprobs is None
    tokens = [e.token_id for e in entries]
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + tokens])).logits[0].double()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    for pos, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(float(logp[pos, entry.token_id]), abs=1e-4)
        assert [t for t, _ in entry.top] == logp[pos].topk(4).indices.tolist()
