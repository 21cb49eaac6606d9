"""A step that raises because of one request, on the real engine (tiny random Llama): stepped
one by one, that request fails alone and the others go on token for token as if nothing had
happened, sampled ones included (a seeded sample depends on its position only)."""

from __future__ import annotations

import pytest

from llmq.common.protocol import EngineRequest
from llmq.common.sampling_params import SamplingParams
from llmq.worker.backends import GenerationBackend
from llmq.worker.failed_step import step_one_by_one
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm

pytestmark = pytest.mark.unit

PROMPTS = {"a": [5, 6, 7, 8], "bad": [9, 10, 11], "c": list(range(20, 60))}


def params(rid: str) -> SamplingParams:
    if rid == "c":  # sampled, seeded
        return SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(model, fault_at: int | None) -> tuple[dict[str, list[int]], dict[str, Exception]]:
    """Generate every request; from step ``fault_at`` on, any step holding "bad" raises."""
    engine = LLMEngine(model, EngineConfig(num_blocks=256, cuda_graphs=False))
    backend = GenerationBackend(engine)
    requests = {rid: EngineRequest(rid, p, params(rid)) for rid, p in PROMPTS.items()}
    for req in requests.values():
        backend.add(req, [])
    execute = engine.runner.execute

    def faulty(out):
        late = fault_at is not None and engine.num_steps >= fault_at
        if late and any(s.seq.request_id == "bad" for s in out.scheduled):
            raise RuntimeError("a kernel failed on bad")
        return execute(out)

    engine.runner.execute = faulty
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    failed: dict[str, Exception] = {}
    while backend.has_unfinished():
        try:
            news = backend.step()
        except RuntimeError:
            live = {rid: r for rid, r in requests.items() if rid in engine.requests}
            result = step_one_by_one(backend, live)
            news = result.news
            failed.update({rid: exc for rid, (_, exc) in result.failed.items()})
            assert all(i == len(tokens[rid]) for rid, (i, _) in result.failed.items())
        for rid, msg in news:
            assert msg.index == len(tokens[rid])
            tokens[rid].extend(msg.tokens)
    return tokens, failed


def test_one_faulty_request_fails_alone_and_the_others_stay_exact(llama_dir):
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    expected, none = run(model, None)
    got, failed = run(model, fault_at=4)
    assert none == {} and list(failed) == ["bad"]
    assert "a kernel failed on bad" in str(failed["bad"])
    assert len(got["bad"]) == 4 and got["bad"] == expected["bad"][:4]
    for rid in ("a", "c"):
        assert len(expected[rid]) == 12
        assert got[rid] == expected[rid], rid
