"""llmq's 6-bit kernel (``q6_matmul``; AVX512-VNNI or AVX2): the product of the activations as
they are quantized (int8 per row and block of 32) with the dequantized ``Int6Blocks``, over odd
shapes, both dtypes and a bias; its largest integer sums exact; a row's bits independent of its
batch; a tied table's rows read back from the panels (both with Q6_K's scales too); int8
where the kernel does not serve."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.linear.quantized_linear import (
    Int6Linear,
    Int8Linear,
    Q6KLinear,
    int_kernel_available,
    quantized_linear,
)
from llmq.worker.runner.linear.quantized_weights import Int4Blocks, Int6Blocks
from tests.worker.runner.test_int_matmul import assert_near_reference, quantized_rows
from tests.worker.runner.test_q6k_matmul import random_q6k

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

# (rows, out features, in features): every row-block remainder (1-8 rows a pass), a last
# super-block of fewer than 8 groups, a slice of 1,024 rows packed last and padded.
SHAPES = [
    (1, 97, 64),
    (5, 33, 96),
    (17, 64, 288),
    (64, 48, 160),
    (2, 1, 32),
    (130, 200, 96),
    (3, 1037, 64),
]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_kernels.load(), "the kernels did not build (is g++ installed?)"
    if not int_kernel_available():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2: 6-bit tensors take int8")


def _blocks(n: int, k: int, gen: torch.Generator) -> Int6Blocks:
    """Random values 0..63, steps of very different sizes, codes of either sign."""
    supers, groups = -(-k // 256), k // 32
    return Int6Blocks(
        torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8),
        (torch.rand(n, supers, generator=gen) * 1e-3 + 1e-4).half(),
        (torch.randn(n, supers, generator=gen) * 1e-2).half(),
        torch.randint(0, 256, (n, groups), generator=gen, dtype=torch.uint8),
        torch.randint(-127, 128, (n, groups), generator=gen, dtype=torch.int8),
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_the_quantized_rows_times_the_dequantized_weight(shape, dtype, with_bias):
    rows, n, k = shape
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = _blocks(n, k, gen)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    x[0, :32] = 0  # an all-zero block (d = 0)
    y = Int6Linear(weight, bias)(x)
    # float32 sums of the group terms: scale * sum(xq * q) and base * sum(xq)
    step, base = (t.double().repeat_interleave(32, 1) for t in weight.group_scales())
    assert_near_reference(y, x, weight.dequantize(), bias, 63 * step + base.abs())


@pytest.mark.parametrize("sign", [1, -1])
def test_a_step_s_largest_sums_are_exact(sign):
    """Every value 63 and every activation at +-127 once quantized: a step's two pair sums, added
    in int16 on AVX2 before they are widened, are as large as they get, and still exact."""
    rows, n, k = 3, 16, 256
    weight = Int6Blocks(
        torch.full((n, k), 63, dtype=torch.uint8),
        torch.full((n, 1), 1e-3).half(),
        torch.zeros(n, 1).half(),
        torch.full((n, k // 32), 255, dtype=torch.uint8),
        torch.zeros(n, k // 32, dtype=torch.int8),
    )
    x = torch.full((rows, k), 2.0 * sign)
    y = Int6Linear(weight, None)(x)
    ref = quantized_rows(x) @ weight.dequantize().double().T
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=0), float((y.double() - ref).abs().max())


# Both scales' forms on the same panels: k-quant super-blocks, and a GGUF's Q6_K (256 wide).
FORMS = [(Int6Linear, _blocks, 320), (Q6KLinear, random_q6k, 512)]


@pytest.mark.parametrize("linear_class, blocks, k", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_in_any_batch(linear_class, blocks, k, dtype):
    """Rows 0-7 and 8-15 in passes of 8 rows, 16-18 in one of 3, each alone in one of 1."""
    gen = torch.Generator().manual_seed(7)
    linear = linear_class(blocks(70, k, gen), torch.randn(70, generator=gen))
    x = torch.randn(19, k, generator=gen).to(dtype)
    batch = linear(x)
    for r in (0, 7, 8, 18):
        assert torch.equal(linear(x[r : r + 1])[0], batch[r])


def test_quantized_linear_takes_six_bits_on_the_kernel_and_int8_off_it():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 128, generator=gen)
    assert isinstance(quantized_linear(weight, None, 6), Int6Linear)
    assert isinstance(quantized_linear(weight, None, 6, kernel=False), Int8Linear)
    assert isinstance(quantized_linear(weight[:, :100], None, 6), Int8Linear)  # not whole groups


def test_six_bits_hold_a_weight_far_closer_than_four():
    """63 levels a group against 15: the mean squared error about (15 / 63)^2 of int4's."""
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(11))
    six = (Int6Blocks.quantize(weight).dequantize() - weight).pow(2).mean()
    four = (Int4Blocks.quantize(weight).dequantize() - weight).pow(2).mean()
    assert 0.04 < float(six / four) < 0.08, float(six / four)


@pytest.mark.parametrize("linear_class, blocks, k", FORMS)
def test_the_panels_give_back_the_rows_a_tied_table_reads(linear_class, blocks, k):
    gen = torch.Generator().manual_seed(3)
    weight = blocks(1037, k, gen)
    linear = linear_class(weight, None)
    ids = torch.tensor([0, 15, 16, 1036, 511, 15])
    got, want = linear.rows(ids), weight.rows(ids)
    assert type(got) is type(want)
    for field in dataclasses.fields(want):
        name = field.name
        assert torch.equal(getattr(got, name), getattr(want, name)), name
