"""The 8-bit KV cache (LLMQ_KV_CACHE_DTYPE=int8|fp8): codes and a float32 scale per token and
KV head, quantized as written, dequantized as read.

Unit: the round trip's error bound; the C++ kernel's 8-bit decode attention against a reference
that dequantizes the same cache and attends in float64. Engine: greedy output in float32 equal
to an independent reference (transformers' own forward, every key and value quantized and
dequantized per token and head after the rotary embedding, as the cache stores them), with the
chosen tokens' logprobs close to the reference's and further from the float cache's; in
batches, chunked, preempted, from the prefix cache, on the kernel, the torch path and
transformers' forward. Pool: the same memory holds ~4x the float32 blocks (~2x bfloat16).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.kv_sizing import kv_pool_size
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.attention.kv_pool import KVPool
from llmq.worker.runner.attention.kv_quant import code_dtype, dequantize, quantize
from tests.worker.runner.test_paged_decode_kernel import reference as float64_attention
from tests.worker.test_engine_exact import ARRIVALS, EOS, make_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def fake_quant(x: torch.Tensor, codes: torch.dtype) -> torch.Tensor:
    """x [..., D] as an 8-bit cache holds it, written out independently of kv_quant: symmetric,
    scale = max |x| of the row / 127 (448 for e4m3), codes rounded to nearest (even)."""
    top = 127.0 if codes == torch.int8 else 448.0
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / top).clamp_min(torch.finfo(torch.float32).tiny)
    if codes == torch.int8:
        q = torch.round(xf / scale).clamp(-top, top)
    else:
        q = (xf / scale).clamp(-top, top).to(codes).float()
    return (q * scale).to(x.dtype)


# ---- unit: the codes ------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_within_half_a_step(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 40, 64, generator=g) * torch.rand(3, 40, 1, generator=g) * 8).to(dtype)
    x[1, 5] = 0  # a row of zeros: zeros back, no NaN
    q, scale = quantize(x, torch.int8)
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]
    back = dequantize(q, scale, torch.int8, torch.float32)
    amax = x.float().abs().amax(-1, keepdim=True)
    err = (back - x.float()).abs()
    assert (err <= amax / 254 * (1 + 1e-5)).all()
    assert (q.abs().amax(-1)[amax[..., 0] > 0] == 127).all()  # the full range is used
    assert torch.equal(back[1, 5], torch.zeros(64))
    assert torch.equal(back, fake_quant(x.float(), torch.int8))


@pytest.mark.unit
def test_fp8_round_trip_within_half_a_mantissa_step():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 33, 128, generator=g) * 3
    q, scale = quantize(x, torch.float8_e4m3fn)
    assert q.dtype == torch.uint8  # stored as bytes
    back = dequantize(q, scale, torch.float8_e4m3fn, torch.float32)
    # e4m3: 3 mantissa bits (half a step: 1/16 of |x|); subnormals below 2^-6 step 2^-9.
    bound = torch.maximum(x.abs() / 16, scale[..., None] * 2**-10) * (1 + 1e-5)
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back, fake_quant(x, torch.float8_e4m3fn))


@pytest.mark.unit
@pytest.mark.parametrize("name", ["int8", "fp8", "auto"])
def test_pool_reads_back_what_it_wrote(name):
    """Written at scattered slots, read back by every path in the model's dtype."""
    pool = KVPool(2, 2, 16, 8, 4, torch.float32, torch.device("cpu"), cache_dtype=name)
    g = torch.Generator().manual_seed(2)
    key, value = torch.randn(2, 2, 6, 16, generator=g)
    slots = torch.tensor([9, 10, 11, 12, 13, 30])
    stored_k, stored_v = pool.write(1, slots, key, value)
    expect_k, expect_v = key, value
    if name != "auto":
        expect_k, expect_v = fake_quant(key, CODES[name]), fake_quant(value, CODES[name])
        assert not torch.equal(expect_k, key)
    assert torch.equal(stored_k, expect_k) and torch.equal(stored_v, expect_v)
    k, v = pool.context(1, torch.tensor([2, 3]), 5)  # slots 8..12: the first unwritten
    assert torch.equal(k[0, :, 1:], expect_k[:, :4]) and not k[0, :, 0].any()
    assert torch.equal(v[0, :, 1:], expect_v[:, :4])
    ids = (pool.head_offsets + torch.tensor([7])).view(-1)  # block 7 of every head: slot 30
    gathered = pool.gather_blocks(1, ids, 1).view(4, 4, 16)
    assert torch.equal(gathered[:2, 2], expect_k[:, 5]) and torch.equal(
        gathered[2:, 2], expect_v[:, 5]
    )
    assert not pool.kv[0].any()  # the other layer untouched


# ---- unit: the kernel -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels():
    assert cpu_kernels.load(), "the kernels did not build (is g++ installed?)"


def kernel_case(name, n, contexts, heads, kv_heads, head_dim, block_size, dtype, **features):
    """The 8-bit kernel's output over a random cache, and float64 attention over the same
    cache dequantized."""
    g = torch.Generator().manual_seed(len(contexts) + head_dim)
    num_blocks = sum(-(-c // block_size) for c in contexts) + 2
    kv = torch.randn(2 * kv_heads, num_blocks * block_size, head_dim, generator=g) * 2
    kv[:, ::3, 1] *= 1e-5  # e4m3's subnormal codes (under 2^-6 of the largest, 448)
    codes, scales = quantize(kv, CODES[name])
    cache = dequantize(codes, scales, CODES[name], torch.float64)
    widest = max(-(-c // block_size) for c in contexts)
    order = torch.randperm(num_blocks, generator=g).tolist()
    rows = []
    for c in contexts:
        need = -(-c // block_size)
        rows.append([order.pop() for _ in range(need)] + [0] * (widest - need))
    tables = torch.tensor(rows, dtype=torch.int32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    query = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)[:, :heads]
    out = torch.full((n, heads, head_dim), 7.0, dtype=dtype)
    scale = head_dim**-0.5
    torch.ops.llmq.paged_decode_attention_q8(
        out, query, codes.view(CODES[name]), scales, tables, lens, block_size, scale, **features
    )
    expect = float64_attention(query, cache, tables, lens, block_size, scale, **features)
    return out.double(), expect


@pytest.mark.unit
@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(4, 2, 16, 16), (9, 3, 64, 16), (8, 8, 64, 3), (32, 8, 128, 16), (12, 1, 48, 5)],
)
def test_kernel_equals_attention_over_the_dequantized_cache(
    name, heads, kv_heads, head_dim, block_size
):
    contexts = [1, 17, 40, 300, 64]
    got, expect = kernel_case(
        name, 5, contexts, heads, kv_heads, head_dim, block_size, torch.float32
    )
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=2e-5)


@pytest.mark.unit
@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_kernel_features_and_bfloat16(name):
    """A window, a softcap and sinks; a bfloat16 query within one rounding of the output."""
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(3))
    features = dict(window=7, softcap=5.0, sinks=sinks)
    got, expect = kernel_case(name, 3, [5, 30, 129], 6, 2, 64, 16, torch.float32, **features)
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=2e-5)
    got, expect = kernel_case(name, 3, [5, 30, 129], 6, 2, 64, 16, torch.bfloat16)
    torch.testing.assert_close(got, expect, rtol=2**-7, atol=2e-3)


@pytest.mark.unit
@pytest.mark.usefixtures("kernels")
def test_kernel_refuses_a_mismatched_cache():
    out = query = torch.zeros(1, 2, 16)
    codes = torch.zeros(2, 16, 16, dtype=torch.int8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.llmq.paged_decode_attention_q8(
            out, query, codes, torch.zeros(2, 8), tables, lens, 16, 1.0
        )
    with pytest.raises(RuntimeError, match="int8 or float8"):
        torch.ops.llmq.paged_decode_attention_q8(
            out, query, codes.float(), torch.zeros(2, 16), tables, lens, 16, 1.0
        )


# ---- the pool's size ------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("dtype,ratio", [(torch.float32, 3.76), (torch.bfloat16, 1.88)])
def test_the_same_memory_holds_about_4x_float32_and_2x_bfloat16_blocks(dtype, ratio):
    """The SmolLM2-135M shape (30 layers, 3 KV heads of 64): a row of 64 one-byte codes and a
    4-byte scale against 64 values of 4 (or 2) bytes."""
    sizes = {}
    for name in ("auto", "int8", "fp8"):
        per_block = KVPool.bytes_per_block(30, 3, 64, 16, dtype, name)
        sizes[name] = kv_pool_size(
            bytes_per_block=per_block,
            block_size=16,
            model_limit=8192,
            max_model_len=None,
            max_batch_size=64,
            num_blocks=None,
            kv_cache_memory_gb=1.0,
        ).num_blocks
    assert sizes["int8"] == sizes["fp8"] == 2**30 // (2 * 30 * 3 * 16 * (64 + 4))
    assert ratio <= sizes["int8"] / sizes["auto"] < ratio + 0.01


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_sizes_its_8bit_pool_by_its_bytes(llama_dir, dtype):
    """Through the engine (kv_setup): the blocks that fit the budget, codes and scales counted;
    the pool allocated holds them (and the scratch block) within it."""
    engines = {
        name: LLMEngine(
            load_causal_lm(str(llama_dir), dtype, "cpu"),
            EngineConfig(kv_cache_memory_gb=0.01, kv_cache_dtype=name),
        )
        for name in ("auto", "int8")
    }
    pool = engines["int8"].runner.pool
    assert pool.storage.dtype == torch.int8 and pool.scale_storage.dtype == torch.float32
    # The tiny model: 2 layers, 2 KV heads of 16: 16 + 4 bytes a row against 64 (or 32).
    row = {"float32": 64, "bfloat16": 32}[dtype]
    assert engines["int8"].num_blocks == int(0.01 * 2**30) // (2 * 2 * 2 * 16 * 20)
    assert engines["auto"].num_blocks == int(0.01 * 2**30) // (2 * 2 * 2 * 16 * row)
    assert pool.block_nbytes == 2 * 2 * 2 * 16 * 20
    assert pool.nbytes <= 0.01 * 2**30 + pool.block_nbytes


# ---- the engine against a reference that simulates the cache --------------------------------


def _fake_quant_attention(codes, module, query, key, value, attention_mask, **kwargs):
    """The model's own eager attention (its window, softcap, sinks, MLA's widths) over keys
    and values as the cache holds them."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(
        module, query, fake_quant(key, codes), fake_quant(value, codes), attention_mask, **kwargs
    )


for _name, _codes in CODES.items():
    AttentionInterface.register(
        f"test_kv_{_name}", functools.partial(_fake_quant_attention, _codes)
    )
    # Eager's additive masks (sdpa's may be None, leaving causality to sdpa's is_causal).
    AttentionMaskInterface.register(f"test_kv_{_name}", eager_mask)


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, every step a whole forward without a cache (each key
    and value quantized once, after the rotary embedding, as the pool stores them)."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(n):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
        lp = torch.log_softmax(logits.float(), -1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
        ids.append(token)
    return tokens, logprobs


@functools.cache
def references(path: str, name: str) -> tuple:
    """The prompts, their lengths, and the greedy tokens and logprobs of ``name``'s simulated
    cache ("auto": none) for each."""
    model = load_causal_lm(path, "float32", "cpu")
    if name != "auto":
        model.set_attn_implementation(f"test_kv_{name}")
    prompts, max_tokens = make_prompts(model.config.vocab_size)
    out = [reference_greedy(model, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    return prompts, max_tokens, [t for t, _ in out], [lp for _, lp in out]


def run_engine(engine: LLMEngine, prompts, max_tokens) -> dict[int, tuple[list, list]]:
    """Prompts arriving on test_engine_exact's schedule (those that fit the model's context);
    each one's tokens and logprobs."""
    results: dict[int, tuple[list, list]] = {}
    step = 0
    while step <= max(ARRIVALS) or engine.has_unfinished():
        for i in ARRIVALS.get(step, []):
            if len(prompts[i]) + max_tokens[i] <= engine.max_model_len:
                params = SamplingParams(
                    temperature=0, max_tokens=max_tokens[i], ignore_eos=True, logprobs=0
                )
                engine.add_request(str(i), prompts[i], params)
                results[i] = ([], [])
        for out in engine.step():
            tokens, logprobs = results[int(out.request_id)]
            tokens.extend(out.token_ids)
            logprobs.extend(lp.logprob for lp in out.logprobs or [])
        step += 1
        assert step < 3000
    return results


VARIANTS = {
    # The C++ kernel's 8-bit decodes, an ample pool, no prefix cache.
    "kernel": EngineConfig(num_blocks=256, enable_prefix_caching=False),
    # A pool of 16 blocks (preempted, recomputed) and 40 tokens a step (chunked), torch's path.
    "torch_ops": EngineConfig(num_blocks=16, max_batch_tokens=40, cpu_kernels=False),
    "chunked": EngineConfig(num_blocks=256, max_batch_size=8, max_batch_tokens=24),
    "prefix_cache": EngineConfig(num_blocks=256),
    "hf_forward": EngineConfig(num_blocks=16, max_batch_tokens=40, fast_forward=False),
}
CASES = [("int8", v, a) for v in VARIANTS for a in ("llama", "qwen2")]
CASES += [("fp8", v, a) for v in ("kernel", "torch_ops") for a in ("llama", "qwen2")]
# Sliding windows (KV groups), softcap and windows, sinks, MLA's wider keys.
CASES += [
    ("int8", v, a)
    for v in ("kernel", "torch_ops")
    for a in ("mistral_window", "gemma2", "gpt_oss", "deepseek_v2")
]


@pytest.mark.parametrize("name,variant,arch", CASES)
def test_greedy_equals_the_simulated_cache(model_dir, arch, name, variant):
    path = str(model_dir(arch))
    prompts, max_tokens, expected, expected_lp = references(path, name)
    _, _, _, float_lp = references(path, "auto")
    config = dataclasses.replace(VARIANTS[variant], kv_cache_dtype=name)
    engine = LLMEngine(load_causal_lm(path, "float32", "cpu"), config, eos_token_ids={EOS})
    assert engine.runner.pool.quantized and engine.runner.pool.codes == code_dtype(name)
    results = run_engine(engine, prompts, max_tokens)
    assert len(results) >= 10  # all 16 but on models of short contexts (gemma2, gpt_oss)

    mismatched = [i for i, (tokens, _) in results.items() if tokens != expected[i]]
    assert not mismatched, f"{len(mismatched)} prompts differ: {mismatched}"
    got = torch.tensor([lp for i in results for lp in results[i][1]])
    near = (got - torch.tensor([lp for i in results for lp in expected_lp[i]])).abs()
    far = (got - torch.tensor([lp for i in results for lp in float_lp[i]])).abs()
    # The engine's keys differ from the reference's by float rounding, which now and then
    # moves a value across a rounding boundary of its code: one step of a row (measured: at
    # most 2.1e-3 in a logprob; the median 3e-6 or less).
    assert near.max() < 5e-3 and near.median() < 2e-5
    # The float cache's logprobs are further off (median 0.0023 to 0.018 int8, 0.19-0.25
    # fp8): the engine reads the codes, not float keys.
    assert far.median() > 1e-3 and far.median() > 50 * near.median()
    kernel = variant != "torch_ops" and engine.runner.pool.head_dim % 16 == 0
    assert engine.runner.decode_kernel == kernel
    if variant in ("torch_ops", "hf_forward"):
        assert engine.scheduler.num_preemptions > 0
    if variant == "prefix_cache":
        assert engine.block_manager.prefix_hits > 0
