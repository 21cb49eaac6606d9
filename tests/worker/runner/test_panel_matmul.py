"""llmq's bfloat16 matmul over its own weight panels (``kernels/panel_matmul.cpp``): within one
bfloat16 rounding (plus float32 summation error) of the product in float64, for every row count
around its 8-row passes, widths that end inside a panel, biases, strided inputs, one and two
threads, with either of its sums (vdpbf16ps or float32 FMAs), which give the same bits; on AMX
tiles (where the CPU and the OS allow them) too, each row's bits the same whatever rows share
its call; the faster sums chosen once; malformed operands refused; and a forward whose projections use it as
close to float32 as the oneDNN-packed one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.forward import decoder_forward
from llmq.worker.runner.linear.packed_linear import (
    SUMS_CODES,
    Linear,
    amx_available,
    choose_panel_sums,
    panel_sums,
    panels,
    panels_fit,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.load(), "the kernels did not build (is g++ installed?)"
    if not torch.ops.llmq.panel_matmul_available():
        pytest.skip("this CPU has no AVX512-BF16")


needs_amx = pytest.mark.skipif(
    not (cpu_kernels.load() and amx_available()),
    reason="no AMX tiles here (CPU, compiler or OS)",
)
SUMS = ["dot", "fma", pytest.param("amx", marks=needs_amx)]


@pytest.fixture
def sums(request):
    """The kernel's sums set to ``request.param`` ("dot", "fma" or "amx") for the test, then
    back."""
    with panel_sums(request.param):
        yield request.param


def assert_close_to_exact(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias) -> None:
    exact = x.double() @ w.double().T
    if bias is not None:
        exact += bias.double()
    magnitude = x.double().abs() @ w.double().abs().T
    # One rounding to bfloat16 of the result, and float32 sums of up to K products.
    allowed = exact.abs() * 2.0**-8 + magnitude * x.shape[1] * 2.0**-24 + 1e-30
    error = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert (error <= allowed).all(), f"worst excess {(error - allowed).max().item()}"


@pytest.mark.parametrize("sums", SUMS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 33, 40])
@pytest.mark.parametrize(
    "out_features, in_features", [(64, 576), (100, 64), (31, 2), (33, 258), (50, 1070)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_exact_product(rows, out_features, in_features, with_bias, threads, sums):
    """Around the 8-row passes and AMX's 16-row groups; whole tiles of K (16 pairs) and tails
    (258, 1070: 1 and 7 pairs past them; 2: no whole tile); widths that end inside a panel."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.llmq.panel_matmul(x, panels(w), out_features, bias)
    finally:
        torch.set_num_threads(before)
    assert_close_to_exact(got, x, w, bias)
    # The same rows read from a strided view (every other row of a wider tensor).
    wide = torch.zeros(2 * rows, in_features + 6, dtype=torch.bfloat16)
    wide[::2, 3 : 3 + in_features] = x
    strided = wide[::2, 3 : 3 + in_features]
    assert torch.equal(torch.ops.llmq.panel_matmul(strided, panels(w), out_features, bias), got)


@pytest.mark.parametrize("rows", [8, 9, 16, 23, 64, 130])
@pytest.mark.parametrize("out_features, in_features", [(96, 576), (50, 1536), (33, 2)])
def test_both_sums_give_the_same_bits(rows, out_features, in_features):
    """The float32 FMAs add each pair's products in vdpbf16ps's order, one rounding each: the
    same sums, so the same output, wherever no denormal occurs."""
    g = torch.Generator().manual_seed(rows + in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = (torch.randn(rows, in_features, generator=g) * 3).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    got = {}
    for fma in (False, True):
        with panel_sums(fma):
            got[fma] = torch.ops.llmq.panel_matmul(x, panels(w), out_features, bias)
    assert torch.equal(got[False], got[True])
    assert_close_to_exact(got[True], x, w, bias)


@needs_amx
@pytest.mark.parametrize("out_features, in_features", [(96, 576), (33, 1070)])
def test_amx_rows_do_not_depend_on_their_call(out_features, in_features):
    """A row's output on AMX is the same bits alone, at any place among 2 to 40 rows (a
    speculative check's rows equal their plain decodes)."""
    g = torch.Generator().manual_seed(in_features)
    w = panels(torch.randn(out_features, in_features, generator=g).bfloat16())
    x = torch.randn(40, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    with panel_sums("amx"):
        alone = torch.cat(
            [torch.ops.llmq.panel_matmul(r, w, out_features, bias) for r in x.split(1)]
        )
        for rows in (2, 7, 16, 17, 33, 40):
            for start in sorted({0, 40 - rows, (40 - rows) // 2}):
                got = torch.ops.llmq.panel_matmul(x[start : start + rows], w, out_features, bias)
                assert torch.equal(got, alone[start : start + rows]), (rows, start)


@needs_amx
def test_amx_calls_between_onednn_amx_calls():
    """oneDNN's AMX matmuls release the tiles of the threads they run on: each call on AMX
    configures its threads' tiles again (else its first tile op is an illegal instruction)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1536, 576, generator=g).bfloat16()
    x = torch.randn(64, 576, generator=g).bfloat16()
    with panel_sums("amx"):
        first = torch.ops.llmq.panel_matmul(x, panels(w), 1536, None)
        for _ in range(3):
            F.linear(x, w)  # oneDNN, on AMX where the CPU has it
            assert torch.equal(torch.ops.llmq.panel_matmul(x, panels(w), 1536, None), first)


def test_unavailable_sums_are_refused():
    with pytest.raises(RuntimeError, match="sums 3"):
        torch.ops.llmq.panel_matmul_set_sums(3)
    if not amx_available():
        with pytest.raises(RuntimeError, match="sums 2"):
            torch.ops.llmq.panel_matmul_set_sums(2)


def test_the_faster_sums_are_chosen_once():
    choice = choose_panel_sums()
    assert choice in ("dot", "fma", "amx")
    assert choice != "amx" or amx_available()
    assert torch.ops.llmq.panel_matmul_sums() == SUMS_CODES[choice]
    assert choose_panel_sums() == choice  # timed once per process


def test_linear_with_panels_is_the_kernel():
    w, x = torch.randn(96, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    linear = Linear(w, None, "panels")
    assert linear.packed and linear.weight.shape == (3, 32, 32, 2)
    assert torch.equal(linear(x), torch.ops.llmq.panel_matmul(x, panels(w), 96, None))
    assert panels_fit(w) and not panels_fit(torch.randn(8, 63).bfloat16())
    assert not panels_fit(w.float())


def test_malformed_operands_are_refused():
    w = panels(torch.randn(64, 32).bfloat16())
    x = torch.randn(2, 32).bfloat16()
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.llmq.panel_matmul(torch.randn(2, 30).bfloat16(), w, 64, None)
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.llmq.panel_matmul(x, w, 65, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.llmq.panel_matmul(x, w, 64, torch.zeros(63).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.llmq.panel_matmul(x.float(), w, 64, None)


PROMPTS = [[5, 9, 13, 200, 31], list(range(40, 77)), [7] * 18, [3, 1, 4, 1, 5, 9, 2, 6]]


def first_step_logits(path, dtype: str, layout: str, monkeypatch) -> torch.Tensor:
    """The logits of the first step (every prompt whole) of an engine whose weights are in
    ``layout``."""
    with monkeypatch.context() as m:
        if layout == "onednn":
            m.setattr(decoder_forward, "panels_fit", lambda weight: False)
        engine = LLMEngine(load_causal_lm(str(path), dtype, "cpu"), EngineConfig(num_blocks=64))
    if engine.runner.forward.layout != layout:
        pytest.skip(f"{layout} weights do not serve on this CPU")
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def keep_logits(out):
        logits, *rest = execute(out)
        seen.append(logits.float().clone())
        return (logits, *rest)

    engine.runner.execute = keep_logits
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=1))
    engine.step()
    assert seen[0].shape[0] == len(PROMPTS)
    return seen[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_forward_on_panels_is_as_close_to_float32_as_onednn(arch, request, monkeypatch):
    path = request.getfixturevalue(f"{arch}_dir")
    reference = first_step_logits(path, "float32", "plain", monkeypatch)
    on_panels = first_step_logits(path, "bfloat16", "panels", monkeypatch)
    on_onednn = first_step_logits(path, "bfloat16", "onednn", monkeypatch)
    panel_error = (on_panels - reference).abs().max().item()
    onednn_error = (on_onednn - reference).abs().max().item()
    assert onednn_error > 0 and panel_error <= 2 * onednn_error, (panel_error, onednn_error)
    assert F.cosine_similarity(on_panels, reference, dim=-1).min() > 0.99
