"""Packed projections: padded row counts bound oneDNN's kernels and keep the real rows' bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmq.worker.runner.linear.packed_linear import Linear, can_pack, padded_rows


def test_row_counts_reaching_onednn_are_few_and_waste_little():
    counts = {padded_rows(rows) for rows in range(1, 513)}
    assert len(counts) <= 36, sorted(counts)
    for rows in range(1, 513):
        padded = padded_rows(rows)
        assert padded >= rows
        assert padded == rows or rows > 16  # a lone stream's steps are never padded
        assert padded - rows <= rows // 4


@pytest.mark.parametrize("shape", [(1728, 576), (576, 1536), (4096, 576)])
def test_padded_rows_give_the_bits_of_the_unpadded_projection(shape):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)
    if not can_pack(weight):
        pytest.skip("no packed bf16 projection on this CPU")
    linear = Linear(weight, None, "onednn")
    assert linear.packed
    for rows in (1, 9, 17, 23, 33, 63, 65, 100, 333, 511):
        x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
        out = linear(x)
        assert out.shape == (rows, shape[0])
        assert torch.equal(out, F.linear(x, weight)), rows


def test_varied_step_sizes_build_one_kernel_per_bucket():
    """Steps of 17..512 tokens build as many oneDNN kernels as there are buckets (about 258
    KiB each), not one per token count: a sweep of every count grows the process by little."""
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(1536, 576, generator=gen) * 0.05).to(torch.bfloat16)
    if not can_pack(weight):
        pytest.skip("no packed bf16 projection on this CPU")
    linear = Linear(weight, None, "onednn")
    xs = [torch.randn(rows, 576, generator=gen).to(torch.bfloat16) for rows in range(17, 513)]
    linear(xs[-1])

    def rss_kib() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))

    before = rss_kib()
    for x in xs:
        linear(x)
    # One kernel per count: 496 primitives, about 125 MiB.
    assert rss_kib() - before < 32 * 1024
