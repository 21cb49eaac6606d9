"""llmq's forward for the families beyond Llama's layer: each layer's attention gets what the
model's own forward passes (Gemma 2's softcap, the sliding windows of Gemma 2/3's local layers)
through the same paged attention transformers' forward uses; a step whose contexts all fit in
every window runs whole in C++ (Gemma 3's, its windows past: each layer reads its KV group's);
what the forward does not implement keeps transformers'.
Greedy output equals ``generate`` in float32 (``test_model_coverage`` covers batches, chunks,
preemption and the prefix cache)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmq.common.sampling_params import SamplingParams
from llmq.tools.model_archs import TINY_WINDOW, tiny_config
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner.forward import decoder_forward
from llmq.worker.runner.forward.decoder_families import family

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = [5, 9, 13, 200, 31]  # 5 tokens: the first steps' contexts fit in a window of 8
NEW_TOKENS = 10  # the last ones' do not


def recorded_run(path, monkeypatch):
    """Greedy tokens of PROMPT through the engine; every attention call of the fast forward
    (layer, window, softcap); the steps run whole in C++."""
    calls: list[tuple[int, int | None, float | None]] = []
    attend = decoder_forward.paged_attention

    def recording(module, *args, sliding_window=None, softcap=None, **kwargs):
        calls.append((module.layer_idx, sliding_window, softcap))
        return attend(module, *args, sliding_window=sliding_window, softcap=softcap, **kwargs)

    monkeypatch.setattr(decoder_forward, "paged_attention", recording)
    engine = LLMEngine(load_causal_lm(str(path), "float32", "cpu"), EngineConfig(num_blocks=32))
    forward = engine.runner.forward
    assert isinstance(forward, decoder_forward.DecoderForward)
    in_cpp = [0]
    step_in_cpp = forward._step_in_cpp

    def counted(*args):
        in_cpp[0] += 1
        return step_in_cpp(*args)

    forward._step_in_cpp = counted
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = engine.generate([PROMPT], params)[0]
    return tokens, calls, in_cpp[0]


def reference(path) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
    )
    return out[0, len(PROMPT) :].tolist()


def test_gemma2_passes_its_softcap_and_windows_to_every_attention(model_dir, monkeypatch):
    path = model_dir("gemma2")
    tokens, calls, in_cpp = recorded_run(path, monkeypatch)
    assert tokens == reference(path)
    assert in_cpp == 0  # a softcap: the paged attention's features, never the plain C++ step
    assert {softcap for _, _, softcap in calls} == {2.0}
    # Layer 0 slides: its window once a context is longer than it; layer 1 never.
    assert {w for layer, w, _ in calls if layer == 0} == {None, TINY_WINDOW}
    assert {w for layer, w, _ in calls if layer == 1} == {None}


def test_gemma3_steps_run_in_cpp_each_layer_with_its_groups_window(model_dir, monkeypatch):
    """Every step whole in C++, those past the window too: each layer reads its KV group's
    tables and asks its group's window (test_step_layers: bit-equal to the Python loop)."""
    path = model_dir("gemma3_text")
    tokens, calls, in_cpp = recorded_run(path, monkeypatch)
    assert tokens == reference(path)
    assert in_cpp == NEW_TOKENS and calls == []


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
        (
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                    "original_max_position_embeddings": 256,
                }
            },
            "longrope",
        ),
    ],
)
def test_phi3_rotary_it_does_not_implement_keeps_transformers_forward(options, reason):
    config = tiny_config("phi3")
    for key, value in options.items():
        setattr(config, key, value)
    config = type(config)(**config.to_dict())  # the config's own handling of the options
    model = AutoModelForCausalLM.from_config(config)
    found, why = family(model)
    assert found is None and reason in why
    assert not decoder_forward.supports(model)
    assert decoder_forward.build_forward(model, fast_forward=True, pack=False) is None


def test_each_family_builds_its_layers(model_dir):
    """What each family's layers hold: q/k norms (Qwen 3, Gemma 3), Gemma's four norms of
    1 + weight in float32 and GELU-tanh, Gemma 3's local rotary base for sliding layers."""
    held = {}
    for arch in ("qwen3", "phi3", "gemma2", "gemma3_text"):
        model = load_causal_lm(str(model_dir(arch)), "bfloat16", "cpu")
        forward = decoder_forward.DecoderForward(model, pack=False)
        first = forward.layers[0]
        held[arch] = (
            first.q_norm is not None,
            first.attn_out_norm is not None,
            first.input_norm.dtype,
            first.mlp.activation,
            tuple(layer.rotary for layer in forward.layers),
        )
    assert held["qwen3"] == (True, False, torch.bfloat16, "silu", (0, 0))
    assert held["phi3"] == (False, False, torch.bfloat16, "silu", (0, 0))
    assert held["gemma2"] == (False, True, torch.float32, "gelu_tanh", (0, 0))
    # Layer types sorted: full_attention 0, sliding_attention 1 (layer 0 slides).
    assert held["gemma3_text"] == (True, True, torch.float32, "gelu_tanh", (1, 0))
