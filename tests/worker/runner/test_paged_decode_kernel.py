"""llmq's C++ decode attention (``kernels/paged_decode.cpp``) against attention written out in
float64 over the same pool: ragged contexts, grouped query heads, odd block sizes, strided
queries, and the serial and the parallel split of its work; sliding windows, softcapping and
sinks, alone and together; and against the torch path of ``featured_attention`` on the layers
that ask for them (MLA's key and value widths included)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.attention.paged import (
    DecodeChunk,
    DecodeTables,
    KVPool,
    StepMetadata,
    featured_attention,
)

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.load(), "the kernels did not build (is g++ installed?)"


def reference(query, kv, tables, contexts, block_size, scale, window=0, softcap=0.0, sinks=None):
    """[n, Hq, D] float64: softmax(q k^T * scale) v over each sequence's tokens, as the models'
    eager attention computes it: a query at position ctx - 1 sees the keys after
    ctx - 1 - window (transformers' ``kv_idx > q_idx - W``); scores softcapped as
    ``c * tanh(s / c)``; a head's sink one more logit, its probability dropped."""
    n, hq, d = query.shape
    hkv = kv.shape[0] // 2
    out = torch.empty(n, hq, d, dtype=torch.float64)
    for i in range(n):
        ctx = int(contexts[i])
        seen = [t for t in range(ctx) if not window or t > ctx - 1 - window]
        slots = torch.tensor(
            [int(tables[i, t // block_size]) * block_size + t % block_size for t in seen]
        )
        group = hq // hkv
        k = kv[:hkv, slots].double().repeat_interleave(group, 0)  # [Hq, keys, D]
        v = kv[hkv:, slots].double().repeat_interleave(group, 0)
        scores = torch.einsum("hkd,hd->hk", k, query[i].double()) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        probs = torch.softmax(scores, dim=1)[:, : len(seen)]
        out[i] = torch.einsum("hk,hkd->hd", probs, v)
    return out


def run_case(
    n, contexts, heads, kv_heads, head_dim, block_size, dtype, seed=0, threads=None, **features
):
    """The kernel's output and the reference's, the kernel on ``threads`` threads (None: as
    set)."""
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
    if features.get("sinks") == "random":
        features["sinks"] = torch.randn(heads, generator=g).to(dtype) * 2
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        torch.ops.llmq.paged_decode_attention(
            out[:n], query, kv, tables, lens, block_size, scale, **features
        )
    finally:
        torch.set_num_threads(before)
    assert (out[n] == 7).all()
    return out[:n].double(), reference(query, kv, tables, lens, block_size, scale, **features)


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


# (heads, kv heads, head dim, block size, window): group sizes 1-5 and 10, the fixed passes (head
# dims 64, 128) and the generic ones, windows inside one block, of one block, across edges.
WINDOW_SHAPES = [
    (4, 2, 16, 16, 8),
    (9, 3, 64, 16, 17),
    (8, 8, 64, 3, 5),
    (32, 8, 128, 16, 16),
    (10, 2, 32, 5, 1),
    (5, 1, 128, 7, 33),
]
CONTEXTS = [1, 2, 5, 7, 8, 9, 16, 17, 31, 33, 34, 48, 131]  # shorter and longer than the windows


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", WINDOW_SHAPES)
def test_a_sliding_window_sees_only_its_last_keys(heads, kv_heads, head_dim, block_size, window):
    got, want = run_case(
        len(CONTEXTS), CONTEXTS, heads, kv_heads, head_dim, block_size, torch.float32,
        window=window,
    )  # fmt: skip
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window,softcap,sinks",
    [
        (4, 2, 64, 0, 2.0, None),  # Gemma 2's global layers: a softcap alone
        (4, 2, 64, 8, 2.0, None),  # and its local ones
        (8, 2, 64, 0, 0.0, "random"),  # gpt-oss's global layers: sinks alone
        (8, 2, 64, 8, 0.0, "random"),  # and its windowed ones
        (6, 2, 48, 9, 0.5, "random"),  # all three, generic passes
        (9, 1, 128, 20, 30.0, "random"),
    ],
)
def test_softcap_and_sinks(heads, kv_heads, head_dim, window, softcap, sinks):
    got, want = run_case(
        len(CONTEXTS), CONTEXTS, heads, kv_heads, head_dim, 16, torch.float32, seed=1,
        window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()


def test_features_in_bfloat16_within_one_rounding_of_the_output():
    got, want = run_case(
        4, [3, 64, 255, 300], 9, 3, 64, 16, torch.bfloat16, window=40, softcap=5.0, sinks="random"
    )
    assert (got - want).abs().max() < 8e-3


def test_blocks_before_the_window_are_neither_read_nor_checked():
    """A windowed layer's blocks that fell out of every window may be freed: table entries
    before the window's first block may hold anything (here: -1, the KV groups' null block,
    and 99, past the pool's 10 blocks)."""
    bs, window = 4, 6
    kv = torch.randn(4, 10 * bs, 16)
    tables = torch.tensor([[-1, 99, 3, 7, 2], [5, 1, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([19, 6], dtype=torch.int32)  # 19: keys 13-18, blocks 3 and 4 only
    query = torch.randn(2, 4, 16)
    out = torch.empty(2, 4, 16)
    torch.ops.llmq.paged_decode_attention(out, query, kv, tables, lens, bs, 0.25, window=window)
    safe = tables.clamp(0, 9)
    want = reference(query, kv, safe, lens, bs, 0.25, window=window)
    assert torch.allclose(out.double(), want, atol=2e-6)
    with pytest.raises(RuntimeError, match="out of the pool"):  # the window's own blocks: checked
        torch.ops.llmq.paged_decode_attention(out, query, kv, tables, lens, bs, 0.25, window=12)


def test_many_sequences_split_across_threads():
    """64 sequences of up to 400 tokens: well above the work the kernel keeps on one thread."""
    contexts = [(37 * i) % 400 + 1 for i in range(64)]
    threads = max(torch.get_num_threads(), 2)
    got, want = run_case(64, contexts, 9, 3, 64, 16, torch.float32, 3, threads)
    windowed = run_case(
        64, contexts, 9, 3, 64, 16, torch.float32, 4, threads, window=100, sinks="random"
    )
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
    assert torch.allclose(*windowed, atol=2e-6, rtol=1e-5)


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
    with pytest.raises(RuntimeError, match="one sink a query head"):
        torch.ops.llmq.paged_decode_attention(out, query, kv, table, lens, 16, 1.0, sinks=lens)
    with pytest.raises(RuntimeError, match="window, softcap"):
        torch.ops.llmq.paged_decode_attention(out, query, kv, table, lens, 16, 1.0, window=-1)


def test_without_a_compiler_the_torch_path_is_kept(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load(tmp_path / "cache") is False
    assert "torch's attention path serves" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))


def decode_step(pool: KVPool, rows: list[list[int]], contexts: list[int], window: int):
    """A decode-only step over ``pool``, for the gathered torch path (one chunk, masks as the
    runner builds them) and for the kernel (its tables)."""
    n, bs, nb = len(contexts), pool.block_size, max(len(r) for r in rows)
    padded = [r + [0] * (nb - len(r)) for r in rows]
    k_pos, ctx = torch.arange(nb * bs)[None, :], torch.tensor(contexts)[:, None]

    def additive(hidden):
        mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
        return mask.repeat(pool.num_kv_heads, 1).unsqueeze(1)

    window_masks = {window: additive((k_pos >= ctx) | (k_pos < ctx - window))} if window else None
    chunk = DecodeChunk(
        0, n, nb, torch.tensor(padded).view(-1), additive(k_pos >= ctx), window_masks
    )
    slots = [r[(c - 1) // bs] * bs + (c - 1) % bs for r, c in zip(rows, contexts, strict=True)]
    gathered = StepMetadata(
        pool, torch.tensor(slots), n, [chunk], [], None, frozenset([window]) - {0}, 4096
    )
    tables = DecodeTables(
        torch.tensor(padded, dtype=torch.int32), torch.tensor(contexts, dtype=torch.int32)
    )
    return gathered, dataclasses.replace(gathered, decode_chunks=[], decode_tables=tables)


@pytest.mark.parametrize(
    "heads,kv_heads,key_dim,value_dim,window,softcap,sinks",
    [
        (4, 4, 48, 32, 0, None, False),  # MLA: keys wider than values (DeepSeek V2/V3)
        (4, 4, 32, 48, 0, None, False),  # values wider
        (8, 2, 64, 64, 8, None, True),  # gpt-oss's windowed layers
        (4, 2, 16, 16, 8, 2.0, False),  # Gemma 2's
        (6, 3, 32, 32, 13, 1.5, True),
    ],
)
def test_the_featured_layers_decode_as_the_torch_path(
    heads, kv_heads, key_dim, value_dim, window, softcap, sinks
):
    """``attention.featured_attention``, decodes by the kernel against the gathered
    torch path over the same pool: within float32 rounding."""
    g = torch.Generator().manual_seed(5)
    bs, contexts = 16, [1, 7, 8, 9, 16, 17, 40, 70]
    width = max(key_dim, value_dim)
    pool = KVPool(1, kv_heads, width, 48, bs, torch.float32, torch.device("cpu"))
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g))
    pool.k[..., key_dim:] = 0  # as the layers write them: zero-padded to the pool's width
    pool.v[..., value_dim:] = 0
    order = torch.randperm(48, generator=g).tolist()
    rows = [[order.pop() for _ in range(-(-c // bs))] for c in contexts]
    gathered, kernel = decode_step(pool, rows, contexts, window)
    n = len(contexts)
    query = torch.randn(1, heads, n, key_dim, generator=g)
    key = torch.randn(1, kv_heads, n, key_dim, generator=g)
    value = torch.randn(1, kv_heads, n, value_dim, generator=g)
    sink = torch.randn(heads, generator=g) if sinks else None
    layer = torch.nn.Module()
    layer.layer_idx = 0
    outs = [
        featured_attention(layer, query, key, value, 0.3, step, window or None, softcap, sink)[0]
        for step in (gathered, kernel)
    ]
    assert outs[0].shape == (1, n, heads, value_dim)
    assert torch.allclose(outs[1], outs[0], atol=2e-6, rtol=1e-5), (outs[1] - outs[0]).abs().max()
