"""``Fp8BlockLinear``: fp8 weights with a scale per 128 x 128 block, activations quantized per
128 columns of a row. The weight it multiplies is transformers' own dequantization of the same
blocks (``_dequantize_fp8_weight``), exactly, over widths that are not multiples of 128; its
output is the float64 product of the activations as it quantizes them with that weight, within
the output's rounding and the matmul's accumulation: on a CPU in float32 (the bookkeeping:
padding, scale layout), on a Hopper GPU on cuBLASLt's block-scaled matmul."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from llmq.worker.loading.quant_checkpoint.fp8_tensor import FP8, fp8_block_matmuls
from llmq.worker.runner.linear.fp8_blocks import BLOCK, Fp8BlockLinear

SHAPES = [(200, 300), (256, 1024), (1024, 640)]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not fp8_block_matmuls("cuda"), reason="needs a GPU with block-scaled fp8 matmuls"
        ),
    ),
]


def _blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = (100 * torch.randn(n, k, generator=g)).clamp(-448, 448).to(FP8)
    grid = (-(-n // BLOCK), -(-k // BLOCK))
    # scales over two orders of magnitude: a block's own scale matters
    scale = (10 ** (-3 + 2 * torch.rand(grid, generator=g))).to(torch.bfloat16).float()
    return q, scale


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, :BLOCK] *= 50  # one group of columns far larger than the rest
    return x.to(torch.bfloat16)


@pytest.mark.unit
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_block_scaled_product_equals_the_float64_reference(device, n, k):
    q, scale = _blocks(n, k, seed=n + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    linear = Fp8BlockLinear(q.to(device), scale.to(device), bias.to(device))
    weight = _dequantize_fp8_weight(q, scale, [BLOCK, BLOCK], torch.float32)
    assert torch.equal(linear.dequantize().cpu(), weight)
    for m in (1, 3, 17):
        x = _activations(m, k, seed=m)
        a, a_scale = linear.quantize_activations(x.to(device))
        a, a_scale = a.cpu()[:m, :k].double(), a_scale.cpu()[:m].double()
        groups = a_scale.repeat_interleave(BLOCK, 1)[:, :k]
        exact = (a * groups) @ weight.double().T + bias.double()
        # each group's own scale: the small columns keep their digits beside the large ones
        # (half an fp8 step: 2**-4 relative, 2**-10 of the scale among subnormals)
        error = (a * groups - x.double()).abs()
        assert bool((error <= 2**-4 * x.double().abs() + 2**-10 * groups).all())
        assert bool((groups[:, BLOCK:] < groups[:, :1] / 10).all())
        y = linear(x.to(device)).cpu().double()
        # Hopper's fp8 tensor cores sum a block of 128 columns in about 14 bits before the
        # float32 sum of blocks (DeepSeek-V3's report): errors near 3e-5 of sum |a| |w| on
        # an H200, against 2**-12 here; a misplaced scale is off by far more.
        slack = 2**-7 * exact.abs() + 2**-12 * ((a * groups).abs() @ weight.double().abs().T)
        over = (y - exact).abs() / (slack + 2**-7)
        assert bool((over <= 1).all()), (m, float(over.max()), float((y - exact).abs().max()))
