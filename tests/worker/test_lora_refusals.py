"""Adapters the engine refuses (a rank over the bound, DoRA, modules saved whole, a layer or a
projection the base lacks, a wrong shape, a corrupt or missing file) fail their own requests with
a clear error while the requests beside them run to the end, equal to PEFT's ``generate``; a
quantized base applies adapters equal to an independent per-projection reference."""

from __future__ import annotations

import pytest

from llmq.worker.engine.sequence import LoraRef
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner.lora.lora_weights import PARTS
from tests.worker.lora_cases import (
    EOS,
    bad_adapters,
    drive,
    mismatches,
    mixed_requests,
    params,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def case(lora_cases):
    return lora_cases("llama")


def test_refused_adapters_fail_alone(case, tmp_path):
    bad = bad_adapters(case, tmp_path)
    model = load_causal_lm(case.base, "float32", "cpu")
    engine = LLMEngine(model, EngineConfig(num_blocks=256, max_lora_rank=8), eos_token_ids={EOS})
    names = ["", "r8", "rs8"]
    requests = mixed_requests(case, names)
    for name, (folder, _) in bad.items():
        requests[name] = (case.prompts[0], LoraRef(name, folder))
    run = drive(engine, requests)
    assert not mismatches(case, run, names)
    assert set(run.errors) == set(bad)
    for name, (_, reason) in bad.items():
        error = run.errors[name]
        assert (error.type, error.code) == ("invalid_request_error", "lora_load_failed")
        assert reason in error.message and repr(name) in error.message, error.message
        assert run.tokens[name] == []
    assert set(engine.loras.resident) == {case.ref("r8"), case.ref("rs8")}


class _Reference:
    """A projection plus each of its parts' LoRA delta, part by part, on every row (PEFT's
    arithmetic: ``base(x) + lora_B(lora_A(x)) * scaling`` per projection)."""

    def __init__(self, base, parts, widths, scale):
        self.base, self.parts, self.widths, self.scale = base, parts, widths, scale

    def __call__(self, x):
        y = self.base(x).clone()
        offset = 0
        for a, b, width in zip(*self.parts, self.widths, strict=True):
            if a is not None:
                y[:, offset : offset + width] += (x @ a.t() @ b.t()) * self.scale
            offset += width
        return y


def _with_reference_lora(engine: LLMEngine, folder: str, scale: float) -> None:
    """Wrap ``engine``'s projections in ``_Reference`` for the PEFT adapter at ``folder``."""
    from safetensors.torch import load_file

    tensors = load_file(f"{folder}/adapter_model.safetensors")
    forward = engine.runner.forward
    for index, layer in enumerate(forward.layers):
        owners = {"qkv": (layer, "qkv_proj"), "o": (layer, "o_proj")}
        owners |= {"gate_up": (layer.mlp, "gate_up_proj"), "down": (layer.mlp, "down_proj")}
        for fused, (owner, attr) in owners.items():
            a, b, widths = [], [], []
            for part in PARTS[fused]:
                group = "mlp" if fused in ("gate_up", "down") else "self_attn"
                key = f"base_model.model.model.layers.{index}.{group}.{part}.lora_"
                a.append(tensors.get(key + "A.weight"))
                b.append(tensors.get(key + "B.weight"))
                widths.append(_out_width(forward, part))
            setattr(owner, attr, _Reference(getattr(owner, attr), (a, b), widths, scale))
    forward.fused_step = False  # the Python loop, which calls the references


def _out_width(forward, part: str) -> int:
    heads = {"q_proj": forward.num_heads, "k_proj": forward.num_kv_heads}
    heads["v_proj"] = forward.num_kv_heads
    if part in heads:
        return heads[part] * forward.head_dim
    config = forward.model.config
    return config.hidden_size if part in ("o_proj", "down_proj") else config.intermediate_size


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_base_with_adapters_equals_a_per_projection_reference(case, scheme):
    """Each prompt alone on the quantized model whose projections add the adapter's delta
    part by part (no pool, no fused deltas, no row groups), against all of them at once
    through the pool, mixed with the bare base model."""
    names = ["", "r8", "part16"]
    expected: dict[str, list[list[int]]] = {}
    for name in names:
        reference = LLMEngine(
            load_causal_lm(case.base, "float32", "cpu", scheme),
            EngineConfig(num_blocks=64),
            eos_token_ids={EOS},
        )
        if name:
            r, scale = case.adapters[name], 2.0  # make_adapter's lora_alpha is 2 * rank
            _with_reference_lora(reference, r.path, scale)
        expected[name] = [reference.generate([p], params())[0] for p in case.prompts]
    assert all(expected[n] != expected[""] for n in names[1:])
    engine = LLMEngine(
        load_causal_lm(case.base, "float32", "cpu", scheme),
        EngineConfig(num_blocks=64, max_batch_tokens=64),
        eos_token_ids={EOS},
    )
    assert engine.runner.forward.layout == scheme
    run = drive(engine, mixed_requests(case, names))
    bad = [
        (i, names[i % 3])
        for i in range(len(case.prompts))
        if run.tokens[str(i)] != expected[names[i % 3]][i]
    ]
    assert not bad, bad
