"""A step's layers in one C++ call (``kernels/step_layers.cpp``) against the Python layer loop
with the same C++ ops: bit-equal logits at every step (prompts alone, prompts beside decodes,
decodes alone; prompts in chunks over a cached prefix), bfloat16 with its weights in llmq's
panels or packed for oneDNN, and float32, Llama and Qwen2 (biased projections), 3 and 24
sequences of ragged lengths; and the families whose layers hold more: Qwen 3 (q/k norms), Phi-3
(fused checkpoint projections), Gemma 3 (four norms of 1 + weight, q/k norms, GELU-tanh, a
rotary base for sliding layers; its window longer than the context, and one of 8 tokens, its
windowed and global layers each reading their own KV group's tables); int8 and int4 weights
on torch's kernels; and steps with LoRA adapters' rows (several adapters and the base model in one
step, batched and run by run)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner.forward import decoder_forward

# Not in the fast tier (`make test-unit`): each case builds and runs a model, minutes in all.

FAMILIES = ["qwen3", "phi3", "gemma3_text", "gemma3_windowed"]


@pytest.fixture(scope="module")
def family_dir(model_dir, tmp_path_factory):
    """family_dir(arch): its tiny model; Gemma 3's with a window of 4096 tokens (none here)."""

    def get(arch: str):
        if arch == "gemma3_windowed":  # the tiny Gemma 3's window: 8 tokens, KV groups
            return model_dir("gemma3_text")
        path = model_dir(arch)
        if arch != "gemma3_text":
            return path
        wide = tmp_path_factory.mktemp("gemma3_wide") / "model"
        if not wide.exists():
            shutil.copytree(path, wide)
            config = json.loads((wide / "config.json").read_text())
            (wide / "config.json").write_text(json.dumps({**config, "sliding_window": 4096}))
        return wide

    return get


PROMPTS = [[5, 9, 13, 200, 31], list(range(40, 77)), [7] * 18]
# 24 sequences: decode steps of more rows than the packed matmuls run unpadded (16).
MANY = [[3 + i, 60 + 2 * i, 9] + [11 + i] * i for i in range(24)]
# A 40-token prefix shared by four prompts, 24 prompt tokens a step: chunks over cached blocks
# (their context gathered from the pool, masked), prompt chunks beside decodes.
SHARED = [list(range(100, 140)) + [7 + i] * (3 + 5 * i) for i in range(4)]
CASES = {
    "3": (PROMPTS, EngineConfig(num_blocks=128)),
    "24": (MANY, EngineConfig(num_blocks=128)),
    "chunked": (SHARED, EngineConfig(num_blocks=128, max_batch_tokens=24)),
}


def logged_engine(path, dtype: str, in_cpp: bool, config: EngineConfig, quantization=None):
    """An engine whose runner keeps every step's logits, and the count of steps it ran in C++."""
    engine = LLMEngine(load_causal_lm(str(path), dtype, "cpu", quantization), config)
    forward = engine.runner.forward
    assert forward.small_step_ops and engine.runner.decode_kernel
    if not in_cpp:
        forward.fused_step = False  # the Python loop, over the same C++ ops
    logits_seen: list[torch.Tensor] = []
    in_cpp_steps = [0]
    execute, step_in_cpp = engine.runner.execute, forward._step_in_cpp

    def keep_logits(*args):
        logits, *rest = execute(*args)
        logits_seen.append(logits.clone())
        return (logits, *rest)

    def count(*args):
        in_cpp_steps[0] += 1
        return step_in_cpp(*args)

    engine.runner.execute = keep_logits
    forward._step_in_cpp = count
    return engine, logits_seen, in_cpp_steps


def run_all(engine, prompts, max_tokens: int, loras=None) -> None:
    """Prompt i as request "i" (under ``loras[i]`` where given), stepped until all finish."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, lora=None if loras is None else loras[i])
    while engine.has_unfinished():
        engine.step()


def assert_fused_equals_loop(runs) -> None:
    """``runs``: (logits, steps in C++) of the fused engine, then the loop's. Every step of the
    first in one C++ call, none of the second, and every step's logits bit-equal."""
    (fused, fused_steps), (loop, loop_steps) = runs
    assert loop_steps == 0 and fused_steps == len(fused) == len(loop)  # every step in C++
    for step, (a, b) in enumerate(zip(fused, loop, strict=True)):
        assert torch.equal(a, b), f"step {step}: {(a - b).abs().max()}"


# The families' layers on the 3-sequence and chunked steps (24 sequences add nothing of theirs).
ARCH_CASES = [(arch, case) for arch in ("llama", "qwen2") for case in CASES]
ARCH_CASES += [(arch, case) for arch in FAMILIES for case in ("3", "chunked")]
ARCH_CASES += [("gemma3_windowed", "24")]


@pytest.mark.parametrize("arch, case", ARCH_CASES, ids=[f"{a}-{c}" for a, c in ARCH_CASES])
@pytest.mark.parametrize(
    "dtype, layout",
    [
        ("bfloat16", "panels"),
        ("bfloat16", "onednn"),
        ("bfloat16", "plain"),  # where the CPU packs neither (no AVX512-BF16)
        ("float32", "plain"),
    ],
    ids=["bfloat16-panels", "bfloat16-onednn", "bfloat16-plain", "float32"],
)
def test_layers_in_one_call_equal_the_python_loop(
    arch, dtype, layout, case, request, monkeypatch, family_dir
):
    path = family_dir(arch) if arch in FAMILIES else request.getfixturevalue(f"{arch}_dir")
    prompts, config = CASES[case]
    if layout == "onednn":
        monkeypatch.setattr(decoder_forward, "panels_fit", lambda weight: False)
    # The Python loop with the C++ ops at every step size, as step_layers runs them.
    monkeypatch.setattr(decoder_forward, "SMALL_STEP_OPS_TOKENS", 1 << 20)
    runs = []
    for in_cpp in (True, False):
        engine, logits, in_cpp_steps = logged_engine(path, dtype, in_cpp, config)
        if engine.runner.forward.layout != layout:
            pytest.skip(f"{layout} weights do not serve on this CPU")
        run_all(engine, prompts, 24)
        runs.append((logits, in_cpp_steps[0]))
    assert_fused_equals_loop(runs)
    if case == "chunked":
        assert engine.block_manager.prefix_hits > 0  # chunks over cached blocks
    else:
        assert max(len(step) for step in runs[0][0]) == len(prompts)  # every sequence in one step


@pytest.fixture(scope="module")
def llama_adapters(llama_dir, tmp_path_factory):
    from tests.worker.lora_cases import build_adapters

    return list(build_adapters(llama_dir, tmp_path_factory.mktemp("step-loras")).values())


@pytest.mark.parametrize("case", ["24", "chunked"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_adapters_in_one_call_equal_the_python_loop(
    case, dtype, llama_dir, llama_adapters, monkeypatch
):
    """Requests under four adapters (ranks 8 and 16, one on some projections only) and the base
    model, side by side: the decodes' deltas batched by slot, and a prompt chunk's beside
    decodes run by run."""
    monkeypatch.setattr(decoder_forward, "SMALL_STEP_OPS_TOKENS", 1 << 20)
    prompts, config = CASES[case]
    runs = []
    for in_cpp in (True, False):
        engine, logits, in_cpp_steps = logged_engine(llama_dir, dtype, in_cpp, config)
        # The adapters loaded first (a load runs beside the steps: the steps would differ).
        for k, lora in enumerate(llama_adapters):
            engine.add_request(f"load{k}", [5, 6], SamplingParams(max_tokens=1), lora=lora)
        while engine.has_unfinished():
            engine.step()
        logits.clear()
        in_cpp_steps[0] = 0
        loras = [llama_adapters[i % 5] if i % 5 < 4 else None for i in range(len(prompts))]
        run_all(engine, prompts, 12, loras)
        assert engine.loras.num_loads == 4
        runs.append((logits, in_cpp_steps[0]))
    assert_fused_equals_loop(runs)


# Half of the 16 combinations (the case follows from the other three): every pair of
# (arch, dtype, scheme, case) values still meets, each triple of the first three.
QUANT_CASES = [
    (arch, dtype, scheme, "3" if (arch == "llama") ^ (dtype == "float32") ^ (scheme == "int4")
     else "chunked")
    for arch in ("llama", "qwen2")
    for dtype in ("bfloat16", "float32")
    for scheme in ("int8", "int4")
] + [("gguf", "bfloat16", "gguf", "chunked")]  # fmt: skip


@pytest.mark.parametrize(
    "arch, dtype, scheme, case", QUANT_CASES, ids=["-".join(c) for c in QUANT_CASES]
)
def test_quantized_layers_in_one_call_equal_the_python_loop(
    arch, dtype, scheme, case, request, monkeypatch
):
    """int8 and int4 projections (the int4 plan keeps some at 6 bits, or 8 off llmq's kernels),
    and a GGUF's (Q4_K, Q5_K, Q6_K, Q8_0 on their kernels, layer by layer in different forms),
    in one call as in the loop; Qwen2's biases added after them."""
    path = request.getfixturevalue(f"{arch}_dir")
    prompts, config = CASES[case]
    monkeypatch.setattr(decoder_forward, "SMALL_STEP_OPS_TOKENS", 1 << 20)
    runs = []
    for in_cpp in (True, False):
        engine, logits, in_cpp_steps = logged_engine(path, dtype, in_cpp, config, scheme)
        assert engine.runner.forward.layout == scheme
        run_all(engine, prompts, 12)
        runs.append((logits, in_cpp_steps[0]))
    assert_fused_equals_loop(runs)
