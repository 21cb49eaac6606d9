"""A GGUF's Q6_K tensors on the 6-bit kernel (``q6_matmul`` with Q6_K's scales: ``Q6KLinear``):
the product of the activations as they are quantized (int8 per row and block of 32) with the
dequantized ``Q6KBlocks``, over odd shapes, both dtypes and a bias; its largest sums exact
(a row's bits in any batch and a tied table's rows: ``test_int6_matmul.py``)."""

from __future__ import annotations

import pytest
import torch

from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.linear.quantized_linear import Q6KLinear, int_kernel_available
from llmq.worker.runner.linear.quantized_weights import Q6KBlocks
from tests.worker.runner.test_int_matmul import assert_near_reference, quantized_rows

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

# (rows, out features, in features): every row-block remainder (1-8 rows a pass), panels cut
# short and padded, several super-blocks of 256.
SHAPES = [(1, 97, 256), (5, 33, 512), (17, 64, 768), (2, 1, 256), (130, 200, 256), (3, 1037, 256)]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_kernels.load(), "the kernels did not build (is g++ installed?)"
    if not int_kernel_available():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2: Q6_K tensors take int8")


def random_q6k(n: int, k: int, gen: torch.Generator) -> Q6KBlocks:
    """Random values 0..63, steps of very different sizes, sub-block scales of either sign."""
    return Q6KBlocks(
        torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8),
        (torch.rand(n, k // 256, generator=gen) * 1e-3 + 1e-5).half(),
        torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8),
    )


def _sub_block_scales(weight: Q6KBlocks) -> torch.Tensor:
    """|d * sc| per input column, float64 [N, K]."""
    scale = weight.d.double().repeat_interleave(16, 1) * weight.sc.double()
    return scale.abs().repeat_interleave(16, 1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_the_quantized_rows_times_the_dequantized_weight(shape, dtype, with_bias):
    rows, n, k = shape
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = random_q6k(n, k, gen)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    x[0, :32] = 0  # an all-zero block (d = 0)
    y = Q6KLinear(weight, bias)(x)
    # float32 products of each half's exact integer sum with its d * sc
    assert_near_reference(y, x, weight.dequantize(), bias, 32 * _sub_block_scales(weight))


@pytest.mark.parametrize("value", [0, 63])
def test_a_step_s_largest_sums_are_exact(value):
    """Every value at an end (q - 32 = -32 or 31), every activation at 127 once quantized, the
    scales at their largest: the integer sums and their products as large as they get."""
    rows, n, k = 3, 16, 512
    weight = Q6KBlocks(
        torch.full((n, k), value, dtype=torch.uint8),
        torch.full((n, 2), 1e-3).half(),
        torch.full((n, k // 16), -128, dtype=torch.int8),
    )
    x = torch.full((rows, k), 2.0)
    y = Q6KLinear(weight, None)(x)
    ref = quantized_rows(x) @ weight.dequantize().double().T
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=0), float((y.double() - ref).abs().max())


def test_a_width_not_of_whole_blocks_is_refused():
    q = Q6KBlocks(
        torch.zeros(4, 96, dtype=torch.uint8),
        torch.ones(4, 1).half(),
        torch.ones(4, 6, dtype=torch.int8),
    )
    with pytest.raises(ValueError, match="256"):
        Q6KLinear(q, None)
