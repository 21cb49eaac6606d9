"""Decode steps through the torch.compile'd CPU forward give ``generate``'s tokens.

The engine's exactness load (tests/worker/test_engine_exact.py: 16 prompts arriving while others
decode, batches and contexts changing every few steps) on the tiny Llama with the compiled path
on: float32 greedy tokens equal ``model.generate``'s, with most steps run compiled and none
compiled after the warm-up. In bfloat16 the compiled step's logits stay within bfloat16's
rounding of the eager step's (Inductor fuses and reorders the arithmetic; SiLU goes into the
gate projection's kernel)."""

from __future__ import annotations

import pytest
import torch

from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner.forward.cpu_compile import CompiledDecode
from llmq.worker.runner.packed_batch import pack_step
from tests.worker.test_engine_exact import EOS, drive, make_prompts, reference_outputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_compiled_decode_gives_generates_tokens(llama_dir):
    path = str(llama_dir)
    _, prompts, max_tokens, expected = reference_outputs(path)
    config = EngineConfig(num_blocks=64, max_batch_tokens=64, cpu_compile=True)
    engine = LLMEngine(load_causal_lm(path, "float32", "cpu"), config, eos_token_ids={EOS})
    compiled = engine.runner.compiled
    assert compiled is not None and compiled.warm
    counters = torch._dynamo.utils.counters
    frames = counters["stats"]["unique_graphs"]
    results, _, _ = drive(engine, prompts, max_tokens)
    mismatched = [i for i in range(len(prompts)) if results[str(i)] != expected[i]]
    assert not mismatched, [(i, expected[i], results[str(i)]) for i in mismatched[:3]]
    # Most steps were decode-only and ran compiled; nothing was compiled while serving.
    assert compiled.steps >= engine.num_steps // 2, (compiled.steps, engine.num_steps)
    assert counters["stats"]["unique_graphs"] == frames


def test_compiled_bfloat16_within_rounding_of_eager(llama_dir):
    """The same decode step (six sequences, their prompts prefilled) eager, then compiled (its
    larger-batch graph only, compiled on first use)."""
    engine = LLMEngine(load_causal_lm(str(llama_dir), "bfloat16", "cpu"), EngineConfig())
    prompts = make_prompts(engine.vocab_size)[0][:6]
    seqs = [
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=4))
        for i, p in enumerate(prompts)
    ]
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in seqs):
        engine.step()
    out = engine.scheduler.schedule()
    assert out.num_tokens == len(out.scheduled) == len(prompts)  # a decode-only step
    runner = engine.runner
    eager, _, _ = runner.execute(out)
    batch = pack_step(out.scheduled, runner.block_size, runner.scratch_slot)
    tables = [item.seq.block_table for item in batch.decodes]
    with torch.inference_mode():
        compiled = CompiledDecode(runner.forward, runner.pool).run(
            batch.input_ids, batch.positions, batch.slots, tables
        )
    compiled = compiled.float()
    # bfloat16 keeps 8 bits of mantissa: a few roundings apart is a few 2^-8 of the scale.
    scale = eager.abs().max()
    assert (compiled - eager).abs().max() <= 0.05 * scale, (compiled - eager).abs().max()
    assert (compiled.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.8
    assert not torch.equal(eager[0], eager[1])  # not degenerate
