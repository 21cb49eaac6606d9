"""Quantized projections: torch's int8/int4 kernels against the float32 matmul of the
dequantized weights, the quantizers' rounding, the embedding table, and the int4 plan."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.forward.decoder_forward import DecoderForward
from llmq.worker.runner.linear.quantize import (
    QuantizedEmbedding,
    int4_plan,
    more_bits,
    quantize_forward,
)
from llmq.worker.runner.linear.quantized_linear import (
    GROUP,
    Int4Blocks,
    Int4Linear,
    Int8Linear,
    Int8Weight,
    int_kernel_available,
    quantized_linear,
)

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

# (rows, out features, in features): odd counts of each; int4 needs in features % 32 == 0.
SHAPES = [(1, 97, 64), (5, 33, 96), (3, 5, 33), (17, 64, 128), (64, 48, 160), (2, 1, 32), (9, 7, 7)]


def _within_tolerance(y: torch.Tensor, x: torch.Tensor, deq: torch.Tensor, bias) -> None:
    """The kernels' stated tolerance: output rounding to bfloat16 (2**-8 of the magnitude) plus
    1e-5 of |x| @ |w|.T, against float32 on the bfloat16-rounded activations; in bfloat16 the
    bias's addition rounds once more."""
    xb = x.bfloat16().float()
    product = xb @ deq.T
    ref = product + bias.float()
    bound = 2**-8 * product.abs() + 1e-5 * (xb.abs() @ deq.abs().T)
    if y.dtype == torch.bfloat16:
        bound += 2**-8 * ref.abs()
    err = (y.float() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_dequantized_matmul(shape, bits, dtype):
    rows, n, k = shape
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    linear = quantized_linear(weight, bias, bits, kernel=False)  # llmq's: test_q4_matmul.py
    four = bits == 4 and k % GROUP == 0
    assert isinstance(linear, Int4Linear if four else Int8Linear)
    # torch's int8 kernel takes one scale per channel
    # torch's int4 kernel takes the blocks' scale and zero in bfloat16
    quantized = (
        Int4Blocks.quantize(weight).as_int4_weight() if four else Int8Weight.quantize(weight, False)
    )
    y = linear(x)
    assert y.dtype == dtype and y.shape == (rows, n)
    _within_tolerance(y, x, quantized.dequantize(), bias)


def test_a_row_gets_the_same_bits_in_any_batch():
    """Greedy equality under batching needs each row's output independent of its neighbours."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 128, generator=gen)
    x = torch.randn(40, 128, generator=gen)
    for bits in (8, 4):
        linear = quantized_linear(weight, None, bits, kernel=False)
        whole = linear(x)
        for start, stop in ((0, 1), (5, 6), (3, 20), (39, 40)):
            assert torch.equal(linear(x[start:stop]), whole[start:stop]), (bits, start)


@pytest.mark.parametrize("grouped", [True, False], ids=["group32", "channel"])
def test_int8_rounds_to_the_nearest_step(grouped):
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    q = Int8Weight.quantize(weight, grouped)
    assert q.q.dtype == torch.int8 and int(q.q.abs().max()) <= 127
    step = Int8Weight(torch.ones_like(q.q), q.scale).dequantize()
    assert bool(((q.dequantize() - weight).abs() <= 0.5 * step + 1e-6).all())
    # The largest weight of each channel or group is represented (up to its scale's rounding).
    blocks = q.q.view(64, 3, 32) if grouped else q.q
    assert bool((blocks.abs().amax(dim=-1) >= 126).all())


def test_int4_groups_round_to_the_nearest_step():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(32, 320, generator=gen) * torch.logspace(-2, 0, 320)  # a partial block
    weight[:, :32] += 1  # a group all positive: its base codes above zero
    q = Int4Blocks.quantize(weight)
    assert int(q.q.min()) >= 0 and int(q.q.max()) <= 15 and q.q.dtype == torch.uint8
    assert q.d.shape == q.m_step.shape == (32, 2) and q.sc.shape == q.m.shape == (32, 10)
    scale, base = (t.repeat_interleave(GROUP, dim=1) for t in q.group_scales())
    d = q.d.float().repeat_interleave(8 * GROUP, dim=1)[:, :320]
    m_step = q.m_step.float().abs().repeat_interleave(8 * GROUP, dim=1)[:, :320]
    # Half a step, plus how far the coded scale and base move the grid's ends (half a code each).
    slack = 15 * d / 2 + m_step / 2
    assert bool(((q.dequantize() - weight).abs() <= 0.5 * scale + slack + 1e-6).all())
    # On the whole, as close as a bfloat16 scale and zero per group.
    bf16 = q.as_int4_weight().dequantize()
    assert float((q.dequantize() - weight).pow(2).mean()) < 1.05 * float(
        (bf16 - weight).pow(2).mean()
    )
    with pytest.raises(ValueError, match="multiples of 32"):
        Int4Blocks.quantize(torch.randn(4, 33))


@pytest.mark.parametrize("four", [False, True])
def test_embedding_rows_are_the_dequantized_table(four):
    table = torch.randn(50, 64, generator=torch.Generator().manual_seed(4))
    weight = Int4Blocks.quantize(table) if four else Int8Weight.quantize(table)
    embedding = QuantizedEmbedding(weight, torch.float32, None)
    ids = torch.tensor([0, 7, 49, 7, 3])
    assert torch.equal(embedding(ids), weight.dequantize()[ids])
    if four:  # two values a byte
        assert embedding.int4.q.shape == (50, 32) and embedding.int4.q.dtype == torch.uint8


def test_int4_plan_keeps_llama_cpp_sensitive_tensors_at_6_bits():
    # llama.cpp's use_more_bits for 16 layers: the first and last two, and 4, 7, 10, 13.
    assert [i for i in range(16) if more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert int4_plan(-1, 16, "head") == 6
    assert int4_plan(-1, 16, "embed") == 4
    assert int4_plan(4, 16, "down") == int4_plan(4, 16, "qkv") == 6
    assert int4_plan(4, 16, "gate_up") == int4_plan(4, 16, "o") == 4
    assert int4_plan(5, 16, "down") == int4_plan(5, 16, "qkv") == 4


def _tiny(tied: bool, hidden: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=200,
        hidden_size=hidden,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


def test_int4_takes_two_bits_more_where_an_input_width_is_no_multiple_of_256():
    """As llama.cpp's Q4_K_M falls back to Q5_0 and Q8_0 there: hidden 64, so the layers'
    qkv, o and gate_up at 6 bits (4 in the plan), the head and table at 8 (6); the down
    projection's 256 inputs keep the plan's 4 and 6."""
    assert cpu_kernels.load()
    forward = DecoderForward(_tiny(tied=True, hidden=64), pack=False)
    quantize_forward(forward, "int4")
    first, last = forward.layers
    six = 6 if int_kernel_available() else 8
    assert first.qkv_proj.bits == first.o_proj.bits == first.mlp.gate_up_proj.bits == six
    assert first.mlp.down_proj.bits == 4 and last.mlp.down_proj.bits == six
    assert forward.lm_head.bits == 8


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("tied", [False, True])
def test_quantized_forward_frees_float_weights_and_shares_a_tied_table(scheme, tied):
    model = _tiny(tied)
    table = model.model.embed_tokens.weight.detach().clone()
    forward = DecoderForward(model, pack=False)
    quantize_forward(forward, scheme)
    assert forward.layout == scheme
    layer = forward.layers[1]  # the last layer: more bits in int4's plan (6 on llmq's kernel)
    more = 6 if scheme == "int4" and int_kernel_available() else 8
    assert layer.mlp.down_proj.bits == more and forward.lm_head.bits == more
    assert forward.layers[0].mlp.gate_up_proj.bits == (4 if scheme == "int4" else 8)
    # The model keeps no float projection, head or embedding weights: only norms.
    left = [n for n, p in model.named_parameters() if p.numel() and "norm" not in n]
    assert left == []
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    if tied:  # one table for both: the head's
        assert embedding.row_reader is forward.lm_head
    ids = torch.tensor([1, 2, 199])
    err = (embedding(ids) - table[ids]).abs().max()
    bits = 4 if embedding.row_reader is None else getattr(embedding.row_reader, "bits", 8)
    steps = {4: 7.5, 6: 31.5, 8: 127}[bits]  # half a step: the largest rounding
    assert float(err) <= 0.51 * float(table.abs().max()) / steps
