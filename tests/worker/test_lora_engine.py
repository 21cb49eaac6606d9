"""LoRA adapters in the engine: greedy output under each adapter equals PEFT's ``generate`` with
that adapter (and the merged model's), token for token, whatever shares the batch: 16 requests
over four adapters and the bare base model at once, under preemption, chunked prefill, the
prefix cache, and an adapter pool smaller than the adapters in use (eviction and reload)."""

from __future__ import annotations

import pytest

from llmq.worker.backends import GenerationBackend
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.request_error import RequestError
from tests.worker.lora_cases import (
    ADAPTERS,
    EOS,
    drive,
    mismatches,
    mixed_requests,
    params,
    peft_model,
    references,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = ["", *ADAPTERS]  # request i runs under NAMES[i % 5]: every adapter and the base


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, lora_cases):
    return lora_cases(request.param)


def _engine(case, **config) -> LLMEngine:
    model = load_causal_lm(case.base, "float32", "cpu")
    return LLMEngine(model, EngineConfig(**config), eos_token_ids={EOS})


def test_each_adapter_changes_the_output_and_outputs_are_varied(case):
    """Equality means nothing where an adapter changed no token, or a model repeats one."""
    for name, outputs in case.expected.items():
        assert len({tuple(t) for t in outputs}) == len(outputs), name
        assert len(set().union(*outputs)) > 40, name
        if name:
            changed = sum(a != b for a, b in zip(outputs, case.expected[""], strict=True))
            assert changed >= len(outputs) - 1, name


def test_the_merged_model_gives_peft_s_tokens(case):
    """The reference holds both ways: the adapter unmerged (as llmq applies it) and merged."""
    for name, ref in case.adapters.items():
        merged = references(peft_model(case.base, ref.path, merged=True), case.prompts[:6])
        assert merged == case.expected[name][:6], name


VARIANTS = {
    "ample": dict(num_blocks=256),
    # 14 blocks of 16 tokens: sequences are preempted and recomputed with their adapter.
    "preemption": dict(num_blocks=14, max_batch_tokens=512),
    # 24 tokens a step: prompts prefilled in chunks beside decodes of other adapters.
    "chunked": dict(num_blocks=256, max_batch_size=8, max_batch_tokens=24),
    # Two adapters loaded at a time for four in use: loads wait for one to be unused.
    "two_loaded": dict(num_blocks=256, max_loras=2),
    # The Python loop with torch's ops (decodes attended from gathered blocks).
    "torch_ops": dict(num_blocks=64, max_batch_tokens=40, cpu_kernels=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixed_adapters_equal_peft(case, variant):
    engine = _engine(case, **VARIANTS[variant])
    run = drive(engine, mixed_requests(case, NAMES))
    assert not run.errors
    bad = mismatches(case, run, NAMES)
    assert not bad, f"{len(bad)} requests differ from PEFT's generate: {bad[:3]}"
    pool = engine.loras
    if variant == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if variant == "two_loaded":
        assert len(pool.resident) == 2 and pool.num_loads == 4
        # Again, with the two left loaded: the other two are loaded again (after eviction).
        run = drive(engine, mixed_requests(case, NAMES))
        assert not mismatches(case, run, NAMES)
        assert pool.num_loads >= 6
    else:
        assert pool.num_loads == 4 and len(pool.resident) == 4
    assert GenerationBackend(engine).stats()["loras"] == ",".join(sorted(pool.names().split(",")))


def test_the_prefix_cache_is_shared_under_one_adapter_only(case):
    """The same prompt twice under one adapter: the second takes its full blocks from the
    cache. Under another adapter, or the base model, none: every block hash chains from the
    adapter's root."""
    engine = _engine(case, num_blocks=256)
    longest = case.prompts.index(max(case.prompts, key=len))
    prompt = case.prompts[longest]
    full = (len(prompt) // 16) * 16
    order = ["r8", "r8", "r16", "", "rs8", "r16"]
    cached = []
    for k, name in enumerate(order):
        run = drive(engine, {f"p{k}": (prompt, case.ref(name))})
        assert run.tokens[f"p{k}"] == case.expected[name][longest], name
        cached.append(run.cached[f"p{k}"])
    assert cached == [0, full, 0, 0, 0, full]


def test_a_request_for_an_adapter_waits_while_the_pool_is_in_use(case):
    """One adapter slot, held by a running request: a request for another adapter waits (it
    does not run under the wrong one) and runs once the slot is freed."""
    engine = _engine(case, num_blocks=64, max_loras=1)
    a, b = case.prompts[5], case.prompts[2]
    engine.add_request("a", a, params(), lora=case.ref("r8"))
    engine.add_request("b", b, params(), lora=case.ref("r16"))
    engine.add_request("base", b, params())
    tokens = {"a": [], "b": [], "base": []}
    first_b = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.request_id == "b" and out.token_ids and first_b is None:
                first_b = len(tokens["a"])
    assert first_b == len(tokens["a"]) == 10  # b's first token came after a finished
    assert tokens["a"] == case.expected["r8"][5]
    assert tokens["b"] == case.expected["r16"][2]
    assert tokens["base"] == case.expected[""][2]
    assert list(engine.loras.resident) == [case.ref("r16")]


def test_aborting_a_request_waiting_for_its_adapter(case):
    """Aborted while its adapter loads: it ends at once; the load finishes for the next
    request that names the adapter."""
    engine = _engine(case, num_blocks=64)
    engine.add_request("w", case.prompts[0], params(), lora=case.ref("r8"))
    assert engine.num_waiting == 1 and engine.loras.pending
    out = engine.abort_request("w")
    assert out.finished and not engine.loras.pending and not engine.has_unfinished()
    run = drive(engine, {"again": (case.prompts[0], case.ref("r8"))})
    assert run.tokens["again"] == case.expected["r8"][0]
    assert engine.loras.num_loads == 1


def test_a_model_on_transformers_forward_refuses_adapters(case):
    engine = _engine(case, num_blocks=16, fast_forward=False)
    with pytest.raises(RequestError, match="fast forward"):
        engine.add_request("x", case.prompts[0], params(), lora=case.ref("r8"))
    assert not engine.requests
