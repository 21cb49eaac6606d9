"""W8A8 projections (fp8 on ``torch._scaled_mm``, int8 on ``torch._int_mm``) against the float64
product of the activations as they quantize them and the dequantized weights, on the CPU and, where
one is, on a CUDA GPU; tinygemm's int4 there; and the fp8 plan over a forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmq.worker.runner.forward.decoder_forward import DecoderForward
from llmq.worker.runner.linear.dynamic_quantized import (
    FP8,
    Fp8Linear,
    Int8DynamicLinear,
    quantize_rows,
    quantize_rows_torch,
)
from llmq.worker.runner.linear.quantize import quantize_forward
from llmq.worker.runner.linear.quantized_linear import (
    Int4Blocks,
    Int4Linear,
    Int4Weight,
    Int8Weight,
    quantized_linear,
)
from tests.worker.runner.test_quantized_linear import SHAPES, _tiny

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA GPU"))]


def _fp8_ok(device: str) -> bool:
    return device == "cpu" or torch.cuda.get_device_capability() >= (8, 9)


def _linear(form: str, weight: torch.Tensor, bias: torch.Tensor):
    if form == "fp8":
        return Fp8Linear.quantize(weight, bias)
    return Int8DynamicLinear(Int8Weight.quantize(weight, grouped=False), bias)


def _case(shape, dtype, device, seed: int = 0):
    rows, n, k = shape
    gen = torch.Generator().manual_seed(seed + rows * 1000 + n + k)
    # Columns of very different sizes: a row scale must not round the small ones away.
    columns = torch.logspace(-2, 1, k)[torch.randperm(k, generator=gen)]
    weight = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    x = torch.randn(rows, k, generator=gen) * columns
    bias = torch.randn(n, generator=gen)
    return (t.to(dtype).to(device) for t in (weight, bias, x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["fp8", "int8"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_equals_the_product_of_its_quantized_operands(shape, form, dtype, device):
    if form == "fp8" and not _fp8_ok(device):
        pytest.skip("fp8 needs compute capability 8.9")
    weight, bias, x = _case(shape, dtype, device)
    linear = _linear(form, weight, bias)
    y = linear(x)
    assert y.dtype == dtype and y.shape == (shape[0], shape[1])
    q, scale = quantize_rows(F.pad(x, (0, linear.q.shape[1] - x.shape[1])), linear.dtype)
    a = (q.double() * scale.double())[:, : x.shape[1]].cpu()
    w = linear.dequantize().double().cpu()
    product = a @ w.T
    ref = product + bias.double().cpu()
    # The product rounds to bfloat16 (fp8's matmul writes it; a bfloat16 model's output is
    # it), then a bfloat16 bias's addition rounds once more.
    magnitude = a.abs() @ w.abs().T
    bound = 1e-5 * magnitude + 1e-6
    if form == "fp8" and device == "cuda":
        # cuBLASLt's fp8 matmul on Hopper sums in fewer bits than float32: up to 2.5e-4 of
        # |a| @ |w| measured on an H200 over these shapes.
        bound += 2**-11 * magnitude
    if form == "fp8" or dtype == torch.bfloat16:
        bound += 2**-8 * product.abs()
    if dtype == torch.bfloat16:
        bound += 2**-8 * ref.abs()
    err = (y.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["fp8", "int8"])
def test_weights_round_to_their_format_and_stay_close(form, device):
    if form == "fp8" and not _fp8_ok(device):
        pytest.skip("fp8 needs compute capability 8.9")
    weight, bias, _ = _case((1, 96, 160), torch.float32, device)
    linear = _linear(form, weight, bias)
    err = (linear.dequantize() - weight).abs().cpu()
    top = weight.abs().amax(dim=1, keepdim=True).cpu()
    # int8: half a step of amax / 127; e4m3: 3 mantissa bits, half an ulp is 2**-4 relative.
    bound = 0.51 * top / 127 if form == "int8" else 2**-4 * weight.abs().cpu() + top * 2**-9 / 448
    assert bool((err <= bound + 1e-7).all())


@pytest.mark.parametrize("device", DEVICES)
def test_int8_rows_get_the_same_bits_in_any_batch(device):
    weight, bias, x = _case((33, 64, 96), torch.bfloat16, device)
    linear = _linear("int8", weight, bias)
    whole = linear(x)
    for start, stop in ((0, 1), (3, 7), (5, 33)):
        assert torch.equal(linear(x[start:stop]), whole[start:stop])


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [32, 128])
def test_tinygemm_int4_equals_the_dequantized_matmul(shape, group):
    rows, n, k = shape
    if k % group:
        pytest.skip("int4 widths are multiples of the group")
    weight, bias, x = _case(shape, torch.bfloat16, "cuda")
    q4 = Int4Blocks.quantize(weight).as_int4_weight()
    if group > 32:  # a checkpoint's larger groups: one scale and zero per `group` columns
        q4 = Int4Weight(q4.q, q4.scale[:, :: group // 32], q4.zero[:, :: group // 32], group)
    linear = Int4Linear(q4, bias)
    assert not linear.kernel and linear.packed.is_cuda
    y = linear(x)
    deq = q4.dequantize().double().cpu()
    xb = x.double().cpu()
    product = xb @ deq.T
    ref = product + bias.double().cpu()
    # tinygemm dequantizes each weight to bfloat16 in the kernel (2**-9 of it) before its
    # bfloat16 tensor-core products; then its output and the bias's addition round.
    bound = 2**-8 * (xb.abs() @ deq.abs().T) + 2**-8 * product.abs() + 2**-8 * ref.abs()
    err = (y.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", [FP8, torch.int8])
def test_the_cuda_row_kernel_gives_torchs_numbers(form, dtype):
    gen = torch.Generator().manual_seed(7)
    for rows, cols in ((1, 64), (5, 33), (3, 2500), (0, 16), (17, 4096)):
        x = (torch.randn(rows, cols + 3, generator=gen) * 4).to(dtype).cuda()[:, 3:]  # strided
        if rows:
            x[0, : cols // 2] = 0  # a zero run; and a whole zero row where there are two
        if rows > 1:
            x[1] = 0
        q, scale = quantize_rows(x, form)
        q_ref, scale_ref = quantize_rows_torch(x, form)
        assert torch.equal(scale, scale_ref), (scale - scale_ref).abs().max()
        same = q.view(torch.int8) == q_ref.view(torch.int8)
        assert bool(same.all()), (rows, cols, int((~same).sum()))


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU")
def test_cuda_int8_is_w8a8_per_channel():
    weight, bias, _ = _case((1, 48, 64), torch.bfloat16, "cuda")
    linear = quantized_linear(weight, bias, 8)
    assert isinstance(linear, Int8DynamicLinear) and linear.q.is_cuda


def test_fp8_plan_quantizes_the_projections_and_keeps_head_and_embedding():
    model = _tiny(tied=False)
    embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
    forward = DecoderForward(model, pack=False)
    quantize_forward(forward, "fp8")
    assert forward.layout == "fp8"
    for layer in forward.layers:
        for proj in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(proj, Fp8Linear) and proj.q.dtype == FP8
    assert model.model.embed_tokens.weight is embedding and embedding.numel()
    assert forward.lm_head.weight.data_ptr() == head.data_ptr()
