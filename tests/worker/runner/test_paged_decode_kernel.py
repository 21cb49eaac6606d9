"""llmq's C++ decode attention (``kernels/paged_decode.cpp``) against attention written out in
float64 over the same pool: ragged contexts, grouped query heads, odd block sizes, strided
queries, and the serial and the parallel split of its work."""

from __future__ import annotations

import logging

import pytest
import torch

from llmq.worker.runner import cpu_kernels

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.load(), "the kernels did not build (is g++ installed?)"


def reference(query, kv, tables, contexts, block_size, scale):
    """[n, Hq, D] float64: softmax(q k^T * scale) v over each sequence's first tokens."""
    n, hq, d = query.shape
    hkv = kv.shape[0] // 2
    out = torch.empty(n, hq, d, dtype=torch.float64)
    for i in range(n):
        ctx = int(contexts[i])
        slots = torch.tensor(
            [int(tables[i, t // block_size]) * block_size + t % block_size for t in range(ctx)]
        )
        for h in range(hq):
            kh = h // (hq // hkv)
            k = kv[kh, slots].double()
            v = kv[hkv + kh, slots].double()
            probs = torch.softmax(k @ query[i, h].double() * scale, dim=0)
            out[i, h] = probs @ v
    return out


def run_case(n, contexts, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in contexts) + 3
    kv = torch.randn(2 * kv_heads, num_blocks * block_size, head_dim, generator=g).to(dtype)
    widest = max(-(-c // block_size) for c in contexts)
    order = torch.randperm(num_blocks, generator=g).tolist()
    rows = []
    for c in contexts:
        need = -(-c // block_size)
        rows.append([order.pop() for _ in range(need)] + [0] * (widest - need))
    tables = torch.tensor(rows, dtype=torch.int32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    # Queries as the forward hands them over: heads of a packed row, [n, Hq, D] strided.
    packed = torch.randn(n + 2, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    query = packed[:n, :heads]
    out = torch.full((n + 1, heads, head_dim), 7.0, dtype=dtype)  # the last row: not the kernel's
    scale = head_dim**-0.5
    torch.ops.llmq.paged_decode_attention(out[:n], query, kv, tables, lens, block_size, scale)
    assert (out[n] == 7).all()
    return out[:n].double(), reference(query, kv, tables, lens, block_size, scale)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(4, 2, 16, 16), (9, 3, 64, 16), (8, 8, 64, 3), (32, 8, 128, 16)],
)
def test_float32_matches_attention_written_out(heads, kv_heads, head_dim, block_size):
    contexts = [1, 2, 15, 16, 17, 48, 131]
    got, want = run_case(
        len(contexts), contexts, heads, kv_heads, head_dim, block_size, torch.float32
    )
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_within_one_rounding_of_the_output(dtype):
    contexts = [3, 64, 255, 300]
    got, want = run_case(len(contexts), contexts, 9, 3, 64, 16, dtype)
    # Scores, softmax and sums in float32: the only rounding is the output's own (8 bits of
    # mantissa for bfloat16), on values of magnitude under about 1.
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    assert (got - want).abs().max() < tol


def test_many_sequences_split_across_threads():
    """64 sequences of up to 400 tokens: well above the work the kernel keeps on one thread."""
    contexts = [(37 * i) % 400 + 1 for i in range(64)]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        got, want = run_case(64, contexts, 9, 3, 64, 16, torch.float32, seed=3)
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)


def test_bad_arguments_raise_instead_of_reading_out_of_bounds():
    kv = torch.zeros(4, 32, 64)
    query = torch.zeros(1, 4, 64)
    out = torch.empty(1, 4, 64)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.llmq.paged_decode_attention(out, query, kv, torch.zeros(1, 1), lens, 16, 1.0)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head_dim"):  # 20: no multiple of AVX2's 8 or 512's 16
        torch.ops.llmq.paged_decode_attention(
            torch.empty(1, 4, 20), torch.zeros(1, 4, 20), torch.zeros(4, 32, 20), table, lens,
            16, 1.0,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="out of its table"):  # 17 tokens, one block of 16
        torch.ops.llmq.paged_decode_attention(out, query, kv, table, lens + 12, 16, 1.0)
    with pytest.raises(RuntimeError, match="out of the pool"):  # the pool holds 2 blocks
        torch.ops.llmq.paged_decode_attention(out, query, kv, table + 2, lens, 16, 1.0)


def test_without_a_compiler_the_torch_path_is_kept(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load(tmp_path / "cache") is False
    assert "torch's attention path serves" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))
