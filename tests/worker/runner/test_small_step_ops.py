"""llmq's C++ small-step ops (``kernels/small_step_ops.cpp``) against the torch ops they replace
in the lean decoder forward: the same roundings, so the rotary embedding and the activation are
bit-equal and the norm differs at most by one rounding of the dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.forward.decoder_forward import DecoderForward

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.load(), "the kernels did not build (is g++ installed?)"


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of the dtype's rounding at each value's magnitude."""
    eps = torch.finfo(got.dtype).eps
    scale = want.float().abs().clamp_min(torch.finfo(got.dtype).tiny)
    return ((got.float() - want.float()).abs() / (scale * eps)).max().item()


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """Two threads, so that 40 rows are split between them (the ops' parallel path)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 15, 40])
def test_rms_norm_is_transformers_norm(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    weight = (1 + torch.randn(576, generator=g) / 4).to(dtype)
    got = torch.ops.llmq.rms_norm(x, weight, 1e-5)
    want = DecoderForward._rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == want.shape
    # Only the float32 sum of squares is added in another order (576 terms: a few float32
    # roundings), which moves a reduced-precision result by at most one rounding.
    assert ulps_apart(got, want) <= (16 if dtype == torch.float32 else 1.01)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_a_float32_weight_is_gemmas_norm(dtype):
    """A float32 weight (Gemma's 1 + weight): scaled and weighted in float32, cast back once."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    weight = torch.randn(576, generator=g) / 4
    got = torch.ops.llmq.rms_norm(x, 1.0 + weight, 1e-6)
    f = x.float()
    want = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight)).to(dtype)
    assert torch.equal(DecoderForward._rms_norm(x, 1.0 + weight, 1e-6), want)
    assert got.dtype == dtype
    assert ulps_apart(got, want) <= (16 if dtype == torch.float32 else 1.01)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", ["model", "float32"], ids=["qwen3", "gemma3"])
def test_qk_norm_norms_each_query_and_key_head(dtype, weight_dtype):
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, rows = 9, 3, 64, 5
    qkv = (torch.randn(rows, hq + 2 * hkv, d, generator=g) * 2).to(dtype)
    q_w, k_w = (1 + torch.randn(2, d, generator=g) / 4).unbind(0)
    if weight_dtype == "model":
        q_w, k_w = q_w.to(dtype), k_w.to(dtype)
    got = torch.ops.llmq.qk_norm(qkv, q_w, k_w, hq, hkv, 1e-6)
    query = DecoderForward._rms_norm(qkv[:, :hq], q_w, 1e-6)
    key = DecoderForward._rms_norm(qkv[:, hq : hq + hkv], k_w, 1e-6)
    assert got.shape == (rows, hq + hkv, d)
    assert ulps_apart(got, torch.cat((query, key), 1)) <= (16 if dtype == torch.float32 else 1.01)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [5, 40])
def test_rotary_is_bit_equal_to_the_torch_ops(dtype, rows):
    g = torch.Generator().manual_seed(1)
    hq, hkv, d = 9, 3, 64
    qkv = torch.randn(rows, hq + 2 * hkv, d, generator=g).to(dtype)
    angles = torch.randn(rows, 1, d, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, : hq + hkv]
    rotated = torch.cat((-qk[..., d // 2 :], qk[..., : d // 2]), dim=-1)
    want = qk * cos + rotated * sin
    got = torch.ops.llmq.rotary(qkv, cos, sin, hq + hkv)
    assert got.shape == (rows, hq + hkv, d)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [4, 40])
def test_silu_mul_is_bit_equal_to_the_torch_ops(dtype, rows):
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)
    want = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    assert torch.equal(torch.ops.llmq.silu_mul(gate_up), want)  # the same vectorized exp


def test_bad_shapes_raise():
    with pytest.raises(RuntimeError, match="rms_norm"):
        torch.ops.llmq.rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-5)
    with pytest.raises(RuntimeError, match="rotary"):
        torch.ops.llmq.rotary(torch.zeros(2, 3, 8), torch.zeros(2, 4), torch.zeros(2, 8), 3)
    with pytest.raises(RuntimeError, match="silu_mul"):
        torch.ops.llmq.silu_mul(torch.zeros(2, 7))
