"""The forward's plan (worker/runner/forward/plan.py), decided once per runner, for each family,
dtype and form: which forward, weight layout, layer ops, fused step, decode attention and CUDA
graphs; the one line the worker logs at start; and what `llmq inspect` shows of a heartbeat."""

from __future__ import annotations

import logging

import pytest

from llmq.common.engine_status import EngineStatus
from llmq.tools.inspect_snapshot import render
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.forward.plan import ForwardPlan

# (family, dtype, quantization, engine settings) -> (forward, weights, layer ops, fused step,
# decode attention), on a CPU where llmq's C++ kernels build; CUDA graphs: never on a CPU.
KERNEL_CASES = {
    ("llama", "float32", None, ()): ("llmq", "plain", "cpp", True, "cpp"),
    ("llama", "bfloat16", None, ()): ("llmq", "panels", "cpp", True, "cpp"),
    ("llama", "float32", "int8", ()): ("llmq", "int8", "cpp", True, "cpp"),
    ("llama", "float32", "int4", ()): ("llmq", "int4", "cpp", True, "cpp"),
    ("qwen2", "float32", None, ()): ("llmq", "plain", "cpp", True, "cpp"),
    ("gemma3", "float32", None, ()): ("llmq", "plain", "cpp", True, "cpp"),
    ("gemma3", "bfloat16", None, ()): ("llmq", "panels", "cpp", True, "cpp"),
    # An 8-bit cache: the fused step writes the cache in the model's dtype, so it is off.
    ("llama", "float32", None, (("kv_cache_dtype", "int8"),)): (
        "llmq",
        "plain",
        "cpp",
        False,
        "cpp",
    ),
    ("llama", "float32", None, (("fast_forward", False),)): (
        "transformers",
        "plain",
        "torch",
        False,
        "cpp",
    ),
}
# Without llmq's kernels (LLMQ_CPU_KERNELS=false, or no compiler): torch's ops throughout.
TORCH_CASE = ("llama", "float32", None, (("cpu_kernels", False),))


def plan_of(model_dir, family, dtype, quantization, settings) -> ForwardPlan:
    model = load_causal_lm(str(model_dir(family)), dtype, "cpu", quantization)
    config = EngineConfig(num_blocks=16, **dict(settings))
    return LLMEngine(model, config, eos_token_ids=set()).runner.plan


@pytest.mark.parametrize("case", list(KERNEL_CASES), ids=lambda c: "-".join(map(str, c[:3])))
def test_the_plan_per_family_dtype_and_form(model_dir, case):
    if not cpu_kernels.load():
        pytest.skip("llmq's C++ kernels do not build on this host")
    forward, weights, ops, fused, attention = KERNEL_CASES[case]
    expected = ForwardPlan(forward, weights, ops, fused, attention, cuda_graphs=False)
    assert plan_of(model_dir, *case) == expected


def test_without_the_kernels_torch_runs_every_op(model_dir):
    plan = plan_of(model_dir, *TORCH_CASE)
    assert plan == ForwardPlan("llmq", "plain", "torch", False, "torch", cuda_graphs=False)


def test_the_plan_is_logged_once_and_shown_by_inspect(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="llmq.worker.runner.model_runner")
    plan = plan_of(model_dir, *TORCH_CASE)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("forward plan")]
    line = "llmq forward, weights plain, torch layer ops, no fused step, decode attention by torch"
    assert lines == [f"forward plan: {line}, no CUDA graphs"]
    status = EngineStatus(model="m", forward_plan=plan.describe(), worker="w1")
    heartbeat = EngineStatus.from_redis(status.to_redis(), "w1")
    engine = {"name": heartbeat.worker, **heartbeat.to_redis()}  # as `llmq inspect` reads it
    shown = render({"queues": [], "engines": [engine], "batches": []})
    assert f"    forward: {line}, no CUDA graphs" in shown.splitlines()
