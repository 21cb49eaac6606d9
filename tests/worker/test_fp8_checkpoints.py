"""FP8 checkpoints (transformers' fp8, compressed-tensors' float-quantized), written as
``test_quant_checkpoints`` writes every format: the fp8 matmuls hold the checkpoint's weights as
they are (a scale a row on ``Fp8Linear``, 128 x 128 blocks on ``Fp8BlockLinear``), serve
batched and from the prefix cache as each prompt alone on a GPU with fp8 matmuls, and where
they are served as float ``LLMQ_QUANTIZATION`` applies."""

from __future__ import annotations

import pytest
import torch

from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.loading.quant_checkpoint.fp8_tensor import fp8_block_matmuls, fp8_matmuls
from llmq.worker.runner.linear.dynamic_quantized import Fp8Linear, quantize_rows_torch
from llmq.worker.runner.linear.fp8_blocks import Fp8BlockLinear
from llmq.worker.runner.loaders.checkpoint_weights import fp8_linear, kernel_linear

pytest.importorskip("compressed_tensors")  # its compressors write the reference checkpoints
from tests.worker.test_quant_checkpoints import (  # noqa: E402
    FP8_KINDS,
    OUTPUT_TOKENS,
    _batched,
    _engine,
    _prompts,
    _read,
    checkpoint_builder,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(llama_dir, tmp_path_factory):
    return checkpoint_builder(llama_dir, tmp_path_factory)


@pytest.mark.unit
@pytest.mark.parametrize("kind", list(FP8_KINDS))
def test_fp8_weights_with_a_scale_a_row_run_as_the_checkpoint_holds_them(checkpoints, kind):
    """q, k, v fused into an ``Fp8Linear`` (torch's ``_scaled_mm``; on a CPU its reference):
    the weights it multiplies are the reference's exactly, and its output is the float64
    product of the activations as it quantizes them (fp8 per row) with them, within the
    output's bfloat16 rounding. Off a GPU with fp8 matmuls the loader serves them as float."""
    folder, reference = checkpoints("llama", kind)
    checkpoint = _read(folder)
    names = [f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    want = torch.cat([reference[n] for n in names])
    parts = [checkpoint.quant(n) for n in names]
    assert kernel_linear(parts, None, "cpu") is None  # no fp8 matmuls on a CPU
    linear = fp8_linear(parts, None)
    assert isinstance(linear, Fp8Linear)
    assert torch.equal(linear.dequantize(), want)
    x = torch.randn(5, want.shape[1], generator=torch.Generator().manual_seed(3))
    q, scale = quantize_rows_torch(x, torch.float8_e4m3fn)
    exact = (q.double() * scale.double()) @ want.double().T
    bound = 2**-8 * exact.abs() + 1e-5 * (x.abs().double() @ want.abs().double().T)
    assert bool(((linear(x).double() - exact).abs() <= bound).all())


@pytest.mark.skipif(not fp8_matmuls("cuda"), reason="needs a GPU with fp8 matmuls")
@pytest.mark.parametrize(
    ("arch", "kind"), [("qwen2", "ct-fp8-channel"), ("llama", "fp8-tensor"), ("llama", "fp8-block")]
)
def test_fp8_checkpoints_run_on_fp8_matmuls_batched_as_alone(checkpoints, arch, kind):
    """On a GPU with fp8 matmuls the checkpoint's fp8 weights, as they are, run on
    ``Fp8Linear`` (a scale a row) or, on a Hopper GPU, ``Fp8BlockLinear`` (a down projection
    two blocks wide): batched with a prefix hit as each prompt stepped alone."""
    if kind == "fp8-block" and not fp8_block_matmuls("cuda"):
        pytest.skip("needs a GPU with block-scaled fp8 matmuls")
    folder, _ = checkpoints(arch, kind)
    alone = _engine(folder, "cuda")
    forward = alone.runner.forward
    assert forward.layout == "checkpoint"
    assert isinstance(forward.layers[0].qkv_proj, Fp8Linear)
    down = Fp8Linear if FP8_KINDS[kind] else Fp8BlockLinear
    assert isinstance(forward.layers[1].mlp.down_proj, down)
    prompts = _prompts(alone.runner.model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    expected = [alone.generate([p], params)[0] for p in prompts]
    assert all(len(set(t)) >= OUTPUT_TOKENS // 2 for t in expected), expected
    results, cached = _batched(_engine(folder, "cuda"), prompts)
    assert results == expected
    assert cached["2"] >= 32


def test_a_checkpoint_served_as_float_takes_the_quantization_setting(checkpoints):
    """fp8 on a CPU is served as float; LLMQ_QUANTIZATION=int8 quantizes those float weights
    (the dequantized checkpoint's), as it would a float checkpoint's."""
    folder, reference = checkpoints("llama", "ct-fp8-channel")
    model = load_causal_lm(str(folder), "float32", "cpu", "int8")
    engine = LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids=set())
    forward = engine.runner.forward
    assert forward.layout == "int8"
    want = torch.cat([reference[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"])
    got = forward.layers[0].qkv_proj.rows(torch.arange(want.shape[0])).dequantize()
    assert (got - want).abs().max() <= want.abs().max() / 127  # int8 steps of the float
