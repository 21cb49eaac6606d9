"""The engine's correctness test: greedy output equals ``model.generate(do_sample=False)`` of the
same model run on each prompt alone, token for token, whatever shares its batch.

For tiny random Llama and Qwen2 in float32, 16 prompts (1..200 tokens, four of them sharing a
100-token prefix) arrive at different steps while others decode, under several engine configs:
an ample pool, a pool so small that sequences are preempted and recomputed, a token budget
smaller than the prompts (chunked prefill), and the prefix cache on shared prompts. Then the
ends of generation (stop token, eos, context length), a resumed request and the repetition
penalty against ``generate(repetition_penalty=...)``.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.sequence import FinishReason, SequenceStatus
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 2  # <|im_end|> in the tiny models; ignore_eos keeps generating through it
LENGTHS = [1, 3, 9, 16, 17, 33, 47, 64, 95, 130, 171, 200]
SHARED_PREFIX = 100
SHARED_SUFFIXES = [1, 7, 20, 40]
# step -> indices of the prompts added before that step runs
ARRIVALS = {0: [0, 5, 9], 1: [1, 12], 3: [2, 6, 10], 6: [3, 7, 13, 14], 9: [4, 8, 11, 15]}


def make_prompts(vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in LENGTHS]
    shared = [rng.randrange(3, vocab_size) for _ in range(SHARED_PREFIX)]
    for n in SHARED_SUFFIXES:
        prompts.append(shared + [rng.randrange(3, vocab_size) for _ in range(n)])
    max_tokens = [rng.randint(8, 24) for _ in prompts]
    return prompts, max_tokens


def reference_generate(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,  # do not stop at eos, as ignore_eos
        pad_token_id=0,
    )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == n
    return tokens


def reference_outputs(path: str, device: str = "cpu"):
    """The float32 reference model of ``path`` on ``device``, the test prompts and their
    lengths, and ``generate``'s greedy tokens for each: (model, prompts, max_tokens, expected)."""
    reference_model = load_causal_lm(path, "float32", device)
    prompts, max_tokens = make_prompts(reference_model.config.vocab_size)
    with torch.inference_mode():
        expected = [
            reference_generate(reference_model, p, n)
            for p, n in zip(prompts, max_tokens, strict=True)
        ]
    return reference_model, prompts, max_tokens, expected


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_case(request):
    path = str(request.getfixturevalue(f"{request.param}_dir"))
    reference_model, prompts, max_tokens, expected = reference_outputs(path)
    return request.param, path, prompts, max_tokens, expected, reference_model


def drive(engine: LLMEngine, prompts, max_tokens):
    """Add the prompts on the ARRIVALS schedule, step until all finish. Returns each request's
    tokens, the ids of requests seen with a partly computed prompt after some step, and the
    most prompt tokens each request got from the prefix cache."""
    results: dict[str, list[int]] = {}
    partial: set[str] = set()
    cached: dict[str, int] = {}
    step = 0
    while step <= max(ARRIVALS) or engine.has_unfinished():
        for i in ARRIVALS.get(step, []):
            engine.add_request(
                str(i),
                prompts[i],
                SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True),
            )
            results[str(i)] = []
        for out in engine.step():
            results[out.request_id].extend(out.token_ids)
            cached[out.request_id] = max(cached.get(out.request_id, 0), out.num_cached_tokens)
            if out.finished and engine.scheduler.num_preemptions == 0:
                # The final output (its usage) still reports the hit: finishing freed the blocks.
                assert out.num_cached_tokens == cached[out.request_id]
            expect_done = len(results[out.request_id]) == max_tokens[int(out.request_id)]
            assert out.finished == expect_done
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH
                assert out.request_id not in engine.requests
        live = list(engine.requests.values())
        engine.block_manager.check_invariants(live)
        for seq in live:
            if seq.status is SequenceStatus.RUNNING and (
                0 < seq.num_computed_tokens < seq.num_prompt_tokens
            ):
                partial.add(seq.request_id)
        step += 1
        assert step < 3000, "the engine does not finish"
    assert engine.block_manager.num_used_blocks == 0
    return results, partial, cached


def test_reference_outputs_are_varied(arch_case):
    """A degenerate model (one token repeated) would make the equality meaningless."""
    _, _, prompts, max_tokens, expected, _ = arch_case
    for tokens, n in zip(expected, max_tokens, strict=True):
        assert len(tokens) == n
        assert len(set(tokens)) >= n // 2, tokens
    assert len({tuple(t) for t in expected}) == len(expected)
    assert len({t[0] for t in expected}) >= len(expected) // 2
    assert len(set().union(*expected)) > 100


VARIANTS = {
    # An ample pool, the prefix cache off: the plain ragged-batch path.
    "plain": EngineConfig(num_blocks=256, enable_prefix_caching=False),
    # 16 blocks of 16 tokens: the longest request (224 tokens) fits alone, not beside others.
    "preemption": EngineConfig(num_blocks=16, max_batch_tokens=512),
    # A budget of 24 tokens a step: every prompt longer than that is prefilled in chunks.
    "chunked": EngineConfig(num_blocks=256, max_batch_size=8, max_batch_tokens=24),
    # Prompt tokens beside decodes capped at 7 a step: prompts trickle in, chunked, as decodes run.
    "prefill_cap": EngineConfig(num_blocks=256, max_prefill_tokens_with_decodes=7),
    "prefix_cache": EngineConfig(num_blocks=256),
    # Everything at once: small pool, small budget, few sequences, prefix cache.
    "tight": EngineConfig(num_blocks=16, max_batch_size=4, max_batch_tokens=40),
    # Blocks of 3 tokens: block boundaries fall everywhere, and 80 blocks force preemption.
    "odd_blocks": EngineConfig(block_size=3, num_blocks=80, max_batch_tokens=50),
    # transformers' own forward (with the paged attention) instead of the lean decoder.
    "hf_forward": EngineConfig(num_blocks=16, max_batch_tokens=40, fast_forward=False),
    # torch ops only: decodes attended from gathered blocks, the glue of small steps in torch.
    "torch_ops": EngineConfig(num_blocks=16, max_batch_tokens=40, cpu_kernels=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_equals_generate(arch_case, variant):
    _, path, prompts, max_tokens, expected, _ = arch_case
    config = VARIANTS[variant]
    engine = LLMEngine(load_causal_lm(path, "float32", "cpu"), config, eos_token_ids={EOS})
    results, partial, cached = drive(engine, prompts, max_tokens)

    mismatched = [
        (i, expected[i], results[str(i)])
        for i in range(len(prompts))
        if results[str(i)] != expected[i]
    ]
    assert not mismatched, f"{len(mismatched)} prompts differ from generate(): {mismatched[:3]}"

    assert (engine.runner.forward is None) == (variant == "hf_forward")
    assert engine.runner.decode_kernel == (variant != "torch_ops")
    if variant == "plain":
        assert engine.block_manager.prefix_hits == 0
    if variant in ("preemption", "tight", "odd_blocks", "hf_forward", "torch_ops"):
        assert engine.scheduler.num_preemptions > 0
    if variant in ("chunked", "tight"):
        budget = engine.scheduler.max_batch_tokens
        assert budget < max(len(p) for p in prompts)
        # Every prompt whose uncached part exceeds the budget was computed over several steps.
        longer = {str(i) for i, p in enumerate(prompts) if len(p) - cached[str(i)] > budget}
        assert len(longer) >= 5 and longer <= partial, (longer - partial, budget)
    if variant == "prefix_cache":
        # The three later prompts with the shared prefix each reuse its 6 full blocks.
        hit = (SHARED_PREFIX // 16) * 16
        assert engine.block_manager.prefix_hits >= 3 * hit
        assert [cached[str(i)] for i in (13, 14, 15)] == [hit] * 3


@pytest.mark.parametrize("block_size", [16, 3])
def test_a_prompt_cached_whole_computes_only_its_last_token(arch_case, block_size):
    """The same prompts again: one whose every block is cached (a length that is a multiple of
    the block size) computes only its last token, reading that token's KV from the shared
    block and writing nothing into any cached block; its output is still generate's."""
    _, path, prompts, max_tokens, expected, _ = arch_case
    config = EngineConfig(block_size=block_size, num_blocks=1024)
    engine = LLMEngine(load_causal_lm(path, "float32", "cpu"), config, eos_token_ids={EOS})
    drive(engine, prompts, max_tokens)
    bm, kv = engine.block_manager, engine.runner.pool.kv
    registered = {b.block_id: b.hash for b in bm.blocks if b.hash is not None}
    before = {b: kv[:, :, b * block_size : (b + 1) * block_size].clone() for b in registered}

    results, _, cached = drive(engine, prompts, max_tokens)

    assert [results[str(i)] for i in range(len(prompts))] == expected
    whole = [i for i, p in enumerate(prompts) if len(p) % block_size == 0 and len(p) > 1]
    assert len(whole) >= 2
    for i, p in enumerate(prompts):
        full_blocks = len(p) // block_size * block_size
        assert cached[str(i)] == (len(p) - 1 if i in whole else full_blocks), i
    for b, h in registered.items():
        assert bm.blocks[b].hash == h, "a cached block was evicted: the pool is too small"
        assert torch.equal(kv[:, :, b * block_size : (b + 1) * block_size], before[b]), b


def run_one(engine: LLMEngine, prompt, params, output_token_ids=None):
    engine.add_request("x", prompt, params, output_token_ids=output_token_ids)
    tokens, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
            last = out
    return tokens, last


def test_stops_at_stop_token_eos_and_context_end(arch_case):
    _, path, prompts, _, _, reference_model = arch_case
    prompt = prompts[5]
    with torch.inference_mode():
        ref = reference_generate(reference_model, prompt, 20)
    i = next(i for i in range(3, 20) if ref[i] not in ref[:i])
    stop = ref[i]
    model = load_causal_lm(path, "float32", "cpu")
    engine = LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids={EOS})
    tokens, last = run_one(
        engine, prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop])
    )
    assert tokens == ref[: i + 1] and last.finish_reason is FinishReason.STOP
    # The same token as the model's eos: stops there, unless ignore_eos.
    engine = LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids={stop})
    tokens, last = run_one(engine, prompt, SamplingParams(temperature=0, max_tokens=20))
    assert tokens == ref[: i + 1] and last.finish_reason is FinishReason.STOP
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens, last = run_one(engine, prompt, params)
    assert tokens == ref and last.finish_reason is FinishReason.LENGTH
    # A context of len(prompt) + 7 tokens ends generation after 7.
    config = EngineConfig(num_blocks=64, max_model_len=len(prompt) + 7)
    engine = LLMEngine(model, config, eos_token_ids={EOS})
    tokens, last = run_one(engine, prompt, params)
    assert tokens == ref[:7] and last.finish_reason is FinishReason.LENGTH


def test_resumed_request_continues_exactly(arch_case):
    """A request resumed with the tokens it generated elsewhere continues as if never moved."""
    _, path, prompts, _, _, reference_model = arch_case
    prompt = prompts[8]
    with torch.inference_mode():
        ref = reference_generate(reference_model, prompt, 20)
    engine = LLMEngine(
        load_causal_lm(path, "float32", "cpu"), EngineConfig(num_blocks=64), eos_token_ids={EOS}
    )
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens, last = run_one(engine, prompt, params, output_token_ids=ref[:6])
    assert tokens == ref[6:]
    assert last.num_output_tokens == 20 and last.num_prompt_tokens == len(prompt)


def test_repetition_penalty_matches_generate(arch_case):
    _, path, prompts, _, _, reference_model = arch_case
    chosen = [prompts[i] for i in (0, 4, 7, 12)]
    engine = LLMEngine(
        load_causal_lm(path, "float32", "cpu"), EngineConfig(num_blocks=128), eos_token_ids={EOS}
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    got = engine.generate(chosen, params)
    for prompt, tokens in zip(chosen, got, strict=True):
        with torch.inference_mode():
            ref = reference_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                repetition_penalty=1.3,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert tokens == ref
    # The penalty does change the output (else this test would prove nothing).
    plain = engine.generate(chosen, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert plain != got


def test_packed_bfloat16_weights_give_the_unpacked_tokens(arch_case):
    """bfloat16 on CPU without llmq's kernels packs the projection weights for oneDNN: the same
    tokens (and logits, bit for bit) as the unpacked projections, and the model's own weight
    copies released."""
    _, path, prompts, max_tokens, _, _ = arch_case
    unpacked = LLMEngine(
        load_causal_lm(path, "bfloat16", "cpu"),
        EngineConfig(num_blocks=256, pack_weights=False, cpu_kernels=False),
        eos_token_ids={EOS},
    )
    model = load_causal_lm(path, "bfloat16", "cpu")
    packed = LLMEngine(model, EngineConfig(num_blocks=256, cpu_kernels=False), eos_token_ids={EOS})
    if packed.runner.forward.layout != "onednn":
        pytest.skip("this CPU's oneDNN has no bfloat16 matmul with F.linear's bits")
    assert not unpacked.runner.forward.packed
    attn = model.model.layers[0].self_attn
    assert (
        attn.q_proj.weight.numel() == 0 and model.model.layers[-1].mlp.down_proj.weight.numel() == 0
    )

    expected, _, _ = drive(unpacked, prompts, max_tokens)
    results, _, _ = drive(packed, prompts, max_tokens)
    assert results == expected
    assert len({tuple(t) for t in results.values()}) == len(prompts)  # not degenerate
