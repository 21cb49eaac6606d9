"""llmq's integer kernels (``q4_matmul``, ``q8_matmul``; AVX512-VNNI or AVX2): the product of the activations as they
quantize them (int8 per row and block of 32, in one term or two) with the dequantized weights, over odd shapes
(int8: input widths not a multiple of 32 too; int4: groups of 32 to 256), both dtypes and a
bias; a row's bits independent of its batch; a tied table's rows read back from the int8
panels; torch's kernels still served where asked. Weights with a float16 scale and base per
group (GGUF's Q4_1 and Q5_1, int8 with a minimum) alike, and int8 with a minimum holding the
grids of a GGUF's weights exactly."""

from __future__ import annotations

import itertools

import pytest
import torch

from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.linear.quantized_linear import (
    Int4Blocks,
    Int4Linear,
    Int4Weight,
    Int6Linear,
    Int8Linear,
    Int8Weight,
    int_kernel_available,
    q8_panels,
    q8_panels_from_float,
    quantized_linear,
)
from llmq.worker.runner.linear.quantized_weights import (
    Int4Groups,
    Int6Blocks,
    Int6Groups,
    Int8Groups,
)

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

# (rows, out features, in features, weight group): odd row and output counts, every row-block
# remainder (1-8 rows a pass), a checkpoint's larger groups.
SHAPES = [
    (1, 97, 64, 32),
    (5, 33, 96, 32),
    (17, 64, 128, 32),
    (64, 48, 160, 32),
    (2, 1, 32, 32),
    (11, 40, 256, 64),
    (3, 16, 512, 256),
    (130, 200, 96, 32),
    (3, 1037, 64, 32),  # packed in slices of 1,024 rows, the last one padded
]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_kernels.load(), "the kernels did not build (is g++ installed?)"
    if not int_kernel_available():
        pytest.skip(
            "this CPU has neither AVX512-VNNI nor AVX2: torch's int4 and int8 kernels serve"
        )


def quantized_rows(x: torch.Tensor, terms: int | None = None) -> torch.Tensor:
    """x as the kernels quantize it, dequantized (float64): per row and block of 32 inputs (the
    last one zero-padded), d = max|x| / 127 and x ~ d * round(x / d), in their float32 steps;
    with two terms (``terms``, default the kernels' setting) the residual x - d * xq again so."""
    rows, k = x.shape
    xf = torch.nn.functional.pad(x.float(), (0, -k % 32)).view(rows, -1, 32)
    out = torch.zeros(xf.shape, dtype=torch.float64)
    for _ in range(terms or cpu_kernels.activation_terms()):
        d = xf.abs().amax(-1) / 127
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        xq = torch.round(xf * inv[..., None]).clamp(-127, 127)
        out += xq.double() * d.double()[..., None]
        xf = xf - d[..., None] * xq
    return out.view(rows, -1)[:, :k]


def assert_near_reference(y, x, deq, bias, magnitude) -> None:
    """y (a kernel's output, in x's dtype) against the float64 product of x as the kernels
    quantize it with the dequantized weight ``deq`` [N, K] (plus bias): within 1e-5 of the sum
    of the terms' sizes (``magnitude`` [N, K]: per weight, the largest of the float32 terms it
    enters) plus 1e-6, and 2**-8 of the output's size more in bfloat16."""
    rows, n = x.shape[0], deq.shape[0]
    assert y.dtype == x.dtype and y.shape == (rows, n)
    xd = quantized_rows(x)
    ref = xd @ deq.double().T + (bias.double() if bias is not None else 0)
    bound = 1e-5 * (xd.abs() @ magnitude.T) + 1e-6
    if y.dtype == torch.bfloat16:
        bound = bound + 2**-8 * ref.abs()
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def _weight(n: int, k: int, group: int, gen: torch.Generator, blocks: bool):
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    if blocks:  # steps of very different sizes across the super-blocks, codes of either sign
        supers, groups = -(-k // 256), k // 32
        d = (torch.rand(n, supers, generator=gen) * 1e-3 + 1e-4).half()
        m_step = (torch.randn(n, supers, generator=gen) * 1e-2).half()
        sc = torch.randint(0, 256, (n, groups), generator=gen, dtype=torch.uint8)
        m = torch.randint(-127, 128, (n, groups), generator=gen, dtype=torch.int8)
        return Int4Blocks(q.to(torch.uint8), d, m_step, sc, m)
    scale = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01).bfloat16()
    zero = torch.randn(n, k // group, generator=gen).mul(0.3).bfloat16()
    return Int4Weight(q, scale, zero, group)


def _scale_and_base(weight: Int4Weight | Int4Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Each input column's scale and base (the value of q = 0), float64 [N, K]."""
    if isinstance(weight, Int4Blocks):
        scale, base = (t.double().repeat_interleave(32, 1) for t in weight.group_scales())
        return scale, base
    scale = weight.scale.double().repeat_interleave(weight.group, 1)
    zero = weight.zero.double().repeat_interleave(weight.group, 1)
    return scale, zero - 8 * scale


# Both scale forms: a checkpoint's bfloat16 groups, and k-quant blocks (groups of 32 only).
INT4_CASES = [(s, False) for s in SHAPES] + [(s, True) for s in SHAPES if s[3] == 32]


@pytest.mark.parametrize(("shape", "blocks"), INT4_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_the_quantized_rows_times_the_dequantized_weight(
    shape, blocks, dtype, with_bias, terms
):
    rows, n, k, group = shape
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = _weight(n, k, group, gen, blocks)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    x[0, :32] = 0  # an all-zero block (d = 0)
    y = Int4Linear(weight, bias, kernel=True)(x)
    # float32 sums of the group terms: scale * sum(xq * q) and base * sum(xq)
    step, base = _scale_and_base(weight)
    assert_near_reference(y, x, weight.dequantize(), bias, 15 * step + base.abs())


@pytest.mark.parametrize("sign", [1, -1])
def test_a_group_s_largest_sums_are_exact(sign):
    """Every weight 15 and every activation at +-127 once quantized: each group's integer sums are
    as large as they get (16 products of 15 * 127 in each of a column's int16 lanes on AVX2,
    where they are widened only once a group), and still exact."""
    rows, n, k = 3, 16, 256
    scale = torch.full((n, k // 32), 0.01).bfloat16()
    weight = Int4Weight(torch.full((n, k), 15, dtype=torch.int32), scale, torch.zeros_like(scale))
    x = torch.full((rows, k), 2.0 * sign)
    y = Int4Linear(weight, None, kernel=True)(x)
    ref = quantized_rows(x) @ weight.dequantize().double().T
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=0), float((y.double() - ref).abs().max())


# (rows, out features, in features): input widths off the blocks of 32 too.
INT8_SHAPES = [
    (1, 97, 64),
    (5, 33, 96),
    (3, 5, 33),
    (17, 64, 128),
    (9, 7, 7),
    (130, 50, 200),
    (2, 1037, 40),
]


@pytest.mark.parametrize("shape", INT8_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("grouped", [True, False], ids=["group32", "channel"])
def test_int8_kernel_equals_the_quantized_rows_times_the_dequantized_weight(
    shape, dtype, with_bias, grouped, terms
):
    rows, n, k = shape
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    # Columns of very different sizes: a group's scale is then far from its row's.
    spread = torch.logspace(-3, 1, k)[torch.randperm(k, generator=gen)]
    weight = Int8Weight.quantize(torch.randn(n, k, generator=gen) * spread, grouped)
    assert weight.grouped == grouped
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    x[0, : min(k, 32)] = 0
    y = Int8Linear(weight, bias, kernel=True)(x)
    # float32 sums of the blocks' exact integer sums, each scaled by d
    deq = weight.dequantize().double()
    assert_near_reference(y, x, deq, bias, deq.abs())


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[3] == 32])
@pytest.mark.parametrize("kind", [Int4Groups, Int6Groups], ids=["q4_1", "q5_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float16_groups_equal_the_quantized_rows_times_the_dequantized_weight(
    shape, kind, dtype, terms
):
    """GGUF's Q4_1 and Q5_1 as their files hold them (w = d * q + m, float16 d and m per 32)
    on the int4 and 6-bit kernels: steps of very different sizes, bases of either sign."""
    rows, n, k, _ = shape
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = kind(
        torch.randint(0, kind.LEVELS + 1, (n, k), generator=gen, dtype=torch.uint8),
        (torch.rand(n, k // 32, generator=gen) * 1e-2 * torch.logspace(-2, 0, k // 32)).half(),
        (torch.randn(n, k // 32, generator=gen) * 0.05).half(),
    )
    bias = torch.randn(n, generator=gen).to(dtype)
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    x[0, :32] = 0
    linear = (
        Int4Linear(weight, bias, kernel=True) if kind is Int4Groups else Int6Linear(weight, bias)
    )
    step, base = (t.double().repeat_interleave(32, 1) for t in weight.group_scales())
    assert_near_reference(linear(x), x, weight.dequantize(), bias, kind.LEVELS * step + base.abs())
    if kind is Int6Groups:  # a tied table's rows, read back from the panels
        ids = torch.tensor([0, n - 1, n // 2])
        assert torch.equal(linear.rows(ids).dequantize(), weight.rows(ids).dequantize())


@pytest.mark.parametrize("shape", INT8_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_with_a_minimum_equals_the_quantized_rows_times_the_dequantized_weight(
    shape, dtype, terms
):
    """int8 with a float16 scale and base per group (``Int8Groups``), quantized from float
    weights whose columns differ in size and groups off zero: its unsigned bytes as they are."""
    rows, n, k = shape
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    spread = torch.logspace(-3, 1, k)[torch.randperm(k, generator=gen)]
    floats = torch.randn(n, k, generator=gen) * spread + torch.randn(n, 1, generator=gen)
    weight = Int8Groups.quantize(floats)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    x[0, : min(k, 32)] = 0
    linear = Int8Linear(weight, bias, kernel=True)
    step, base = (t.double().repeat_interleave(32, 1)[:, :k] for t in weight.group_scales())
    assert_near_reference(linear(x), x, weight.dequantize(), bias, 255 * step + base.abs())
    ids = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(linear.rows(ids).dequantize(), weight.rows(ids).dequantize())


def _on_grid(kind: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Float weights on a GGUF type's grid, as a float folder made from its file holds them:
    each group's extreme levels used."""
    groups = k // 32
    d = (torch.rand(n, groups, generator=gen) * 1e-2 + 1e-4).half().float()[..., None]
    top = {"q4_1": 15, "q5_0": 31, "q8_0": 254}[kind]
    q = torch.randint(0, top + 1, (n, groups, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, top
    if kind == "q4_1":
        m = (torch.randn(n, groups, generator=gen) * 0.05).half().float()[..., None]
        return (q * d + m).view(n, k)
    return ((q - (16 if kind == "q5_0" else 127)) * d).view(n, k)


def test_int8_with_a_minimum_holds_a_gguf_s_grids_exactly():
    """Weights dequantized from Q4_1 (a minimum per group), Q5_0 and Q8_0 blocks come back
    exactly, where the symmetric scale rounds the first two; on float weights no group's
    squared error is above the symmetric scale's."""
    gen = torch.Generator().manual_seed(9)
    for kind in ("q4_1", "q5_0", "q8_0"):
        w = _on_grid(kind, 48, 256, gen)
        assert torch.equal(Int8Groups.quantize(w).dequantize(), w), kind
        symmetric = Int8Weight.quantize(w).dequantize()
        assert torch.equal(symmetric, w) == (kind == "q8_0"), kind
    w = torch.randn(64, 512, generator=gen) * 0.02 + torch.randn(64, 1, generator=gen) * 0.01

    def group_error(deq: torch.Tensor) -> torch.Tensor:
        return (deq - w).square().view(64, -1, 32).sum(2)

    ours, symmetric = (
        group_error(q.dequantize()) for q in (Int8Groups.quantize(w), Int8Weight.quantize(w))
    )
    assert bool((ours <= symmetric * (1 + 1e-5)).all())
    assert float(ours.sum()) < 0.9 * float(symmetric.sum())


def test_int8_at_load_takes_a_minimum_where_set(monkeypatch):
    """``LLMQ_INT8_MIN``: int8 at load with a float16 scale and base per group, else the
    symmetric scale; the 8 bits an int4 plan falls back to take the groups either way."""
    from llmq.common.settings import get_settings

    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(11))
    for value, with_min in (("true", True), ("false", False)):
        monkeypatch.setenv("LLMQ_INT8_MIN", value)
        get_settings.cache_clear()
        try:
            assert (quantized_linear(weight, None, 8, kernel=True).scale.dim() == 4) == with_min
            assert quantized_linear(weight, None, 8, kernel=True, groups=True).scale.dim() == 4
        finally:
            get_settings.cache_clear()


def test_int4_blocks_find_a_q4_k_grid_again():
    """Weights dequantized from Q4_K blocks (``d * sc * q - dmin * m``, 6-bit sc and m under a
    float16 d and dmin per 256) taken to int4 at load: the 8-bit codes against a step of 63's
    multiple hold Q4_K's 6-bit ones, within 1e-4 of the weights' size (2e-3 with the largest
    over 255 and 127 alone); on float weights the codes round no worse."""
    gen = torch.Generator().manual_seed(12)
    n, supers = 64, 4

    def steps(top: int) -> torch.Tensor:
        step = (torch.rand(n, supers, 1, generator=gen) * 1e-3 + 1e-4).half().float()
        codes = torch.randint(0, 64, (n, supers, 8), generator=gen).float()
        codes[..., top] = 63  # the super-block's largest code, as llama.cpp's fit leaves it
        return step * codes

    q = torch.randint(0, 16, (n, supers, 8, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    w = (steps(0)[..., None] * q - steps(1)[..., None]).view(n, -1)
    error = (Int4Blocks.quantize(w).dequantize() - w).square().mean().sqrt()
    assert float(error) < 1e-4 * float(w.square().mean().sqrt())


def test_six_bit_groups_find_a_q5_0_grid_again():
    """The 6 bits an int4 plan falls back to where a width is no multiple of 256 (Gemma 3's
    640: llama.cpp's Q5_0 there): in float16 groups a Q5_0 grid comes back within float16's
    rounding, where k-quant blocks' 8-bit codes move it by 0.5%; the kernel serves them."""
    gen = torch.Generator().manual_seed(10)
    w = _on_grid("q5_0", 64, 640, gen)

    def error(deq: torch.Tensor) -> float:
        return float((deq - w).square().mean().sqrt() / w.square().mean().sqrt())

    groups = Int6Groups.quantize(w)
    assert error(groups.dequantize()) < 1e-5 < 1e-3 < error(Int6Blocks.quantize(w).dequantize())
    linear = quantized_linear(w, None, 6, kernel=True, groups=True)
    assert linear.scales_and_zeros.dtype == torch.float16
    x = torch.randn(3, 640, generator=gen)
    step, base = (t.double().repeat_interleave(32, 1) for t in groups.group_scales())
    assert_near_reference(linear(x), x, groups.dequantize(), None, 63 * step + base.abs())


@pytest.fixture(params=[1, 2], ids=["1term", "2terms"])
def terms(request):
    """The kernels' activations in 1 int8 term (llama.cpp's Q8_1 rounding) or 2."""
    before = cpu_kernels.set_activation_terms(request.param)
    yield request.param
    cpu_kernels.set_activation_terms(before)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_in_any_batch(bits, dtype, terms):
    """Whatever the passes a row falls in (of 1 to 8 rows, a row's terms side by side):
    float32 outputs show every bit."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 256, generator=gen)
    linear = quantized_linear(weight, None, bits, kernel=True)
    x = torch.randn(40, 256, generator=gen).to(dtype)
    whole = linear(x)
    for start, stop in ((0, 1), (5, 6), (3, 20), (39, 40), (0, 9)):
        assert torch.equal(linear(x[start:stop]), whole[start:stop]), start


def _linear_of_form(form: str, gen: torch.Generator):
    """A projection [96, 512] of llmq's integer kernels in ``form``, and its dequantized
    weight (float64)."""
    from llmq.worker.runner.linear.quantized_linear import Q6KLinear
    from tests.worker.runner.test_q6k_matmul import random_q6k

    if form == "q6k":
        weight = random_q6k(96, 512, gen)
        return Q6KLinear(weight, None), weight.dequantize().double()
    weight = torch.randn(96, 512, generator=gen)
    linear = quantized_linear(weight, None, {"int4": 4, "int6": 6, "int8": 8}[form], kernel=True)
    ones = torch.eye(512)  # the kernel's own weights, dequantized: its product with I (exact)
    with_terms = cpu_kernels.set_activation_terms(2)
    deq = linear(ones).double().T
    cpu_kernels.set_activation_terms(with_terms)
    return linear, deq


@pytest.mark.parametrize("form", ["int4", "int6", "int8", "q6k"])
def test_two_terms_are_closer_to_the_float_product_than_bfloat16_activations(form):
    """Activations with large and small values in a block (as a model's hidden states): with 2
    terms each form's output is within a tenth of the error bfloat16 activations (torch's
    weight-only kernels) make against the float64 product with the same weights; with 1 term
    (Q8_1's rounding) it is over twice theirs."""
    gen = torch.Generator().manual_seed(8)
    linear, deq = _linear_of_form(form, gen)
    x = torch.randn(6, 512, generator=gen) * torch.logspace(-1, 1, 512)[torch.randperm(512)]
    ref = x.double() @ deq.T

    def error(y: torch.Tensor) -> float:
        return float((y.double() - ref).abs().mean())

    bf16 = error(x.bfloat16().double() @ deq.T)
    before = cpu_kernels.set_activation_terms(2)
    try:
        two = error(linear(x))
        cpu_kernels.set_activation_terms(1)
        one = error(linear(x))
    finally:
        cpu_kernels.set_activation_terms(before)
    assert two < bf16 / 10 and one > 2 * bf16, (two, bf16, one)


@pytest.mark.parametrize("grouped", [True, False, "min"], ids=["group32", "channel", "min"])
def test_a_tied_table_reads_its_rows_from_the_int8_panels(grouped):
    table = torch.randn(50, 40, generator=torch.Generator().manual_seed(4))
    min_ = grouped == "min"
    weight = Int8Groups.quantize(table) if min_ else Int8Weight.quantize(table, grouped)
    ids = torch.tensor([0, 15, 16, 49, 7, 16])
    rows = Int8Linear(weight, None, kernel=True).rows(ids)
    assert torch.equal(rows.q, weight.q[ids])
    assert torch.equal(rows.dequantize(), weight.rows(ids).dequantize())


def test_group_scales_hold_small_columns_that_a_row_scale_rounds_away():
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(64, 256, generator=gen) * 0.01
    weight[:, :32] *= 100  # one group of large inputs, as an outlier channel makes
    err = {
        grouped: (Int8Weight.quantize(weight, grouped).dequantize() - weight)[:, 32:].abs().mean()
        for grouped in (True, False)
    }
    assert err[True] < err[False] / 50, err


@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_serves_where_loaded_and_torch_s_where_asked(bits):
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(5))
    ours = quantized_linear(weight, None, bits)
    torch_s = quantized_linear(weight, None, bits, False)
    assert ours.kernel and not torch_s.kernel
    assert ours.weight.dim() == 5 and torch_s.weight.dim() == 2
    # the same bytes but scales: int4's k-quant blocks 4.625 bits a weight against torch's 5;
    # int8's 8.5 (9 with a minimum per group) against 8 and a scale per channel
    assert ours.nbytes() < torch_s.nbytes() * (0.93 if bits == 4 else 1.13)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(6)).bfloat16()
    # Both are the product with the weight as quantized within their roundings (int8
    # activations against bf16 ones; int8: group scales against channel scales; bf16 outputs).
    deq = Int4Blocks.quantize(weight).dequantize() if bits == 4 else weight
    ref = x.float() @ deq.T
    for linear in (ours, torch_s):
        assert float((linear(x).float() - ref).abs().max()) < 0.015 * float(ref.abs().max())


def test_panels_built_a_slice_at_a_time_equal_the_whole_weights():
    """``q8_panels_from_float`` (a slice of rows quantized and packed at a time) gives the
    panels and scales of the whole weight quantized at once, past a slice and at odd widths."""
    gen = torch.Generator().manual_seed(5)
    for (n, k), with_min in itertools.product(((2500, 96), (1024, 40), (17, 64)), (False, True)):
        weight = torch.randn(n, k, generator=gen).bfloat16()
        before = weight.clone()
        packed, scales = q8_panels_from_float(weight, with_min)
        quantize = Int8Groups.quantize if with_min else Int8Weight.quantize
        whole, whole_scales = q8_panels(quantize(weight))
        assert torch.equal(packed, whole) and torch.equal(scales, whole_scales), (n, k)
        assert torch.equal(weight, before)  # quantized from, never written
