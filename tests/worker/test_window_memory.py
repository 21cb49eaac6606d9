"""Sliding windows that save memory: a long conversation on a model with windowed layers holds
only their windows plus its global layers' context, and its greedy output stays equal to
transformers'.

A Gemma-3-shaped model (gemma3_text: 6 layers, the real 5:1 local/global pattern, a 1,024-token
window; tiny widths) holds a two-turn conversation of 16,000 tokens, the second turn from the
prefix cache. Its blocks held, counted per KV group x the group's bytes per block, stay within
1.2x of (global layers x context + local layers x window), against 6 layers x context without
windows. The reference prefills the prompt through transformers' own model and cache in pieces
(as ``generate`` would in one, 4x slower here), then ``generate`` continues from that cache.
A windowed Mistral (every layer local) holds its window alone.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from llmq.common.sampling_params import SamplingParams
from llmq.tools.model_archs import perturb, tiny_config
from llmq.worker.llm_engine import EngineConfig, LLMEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 512
NEW_TOKENS = 4
REFERENCE_PIECE = 2048


def windowed_model(arch: str, window: int, layer_types: list[str] | None, context: int):
    config = tiny_config(arch, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.vocab_size, config.sliding_window = VOCAB, window
    config.max_position_embeddings = context
    if layer_types:
        config.num_hidden_layers, config.layer_types = len(layer_types), layer_types
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb(model)
    return model


@torch.inference_mode()
def reference(model, tokens: list[int]) -> list[int]:
    ids = torch.tensor([tokens])
    cache = DynamicCache(config=model.config)
    for start in range(0, len(tokens) - 1, REFERENCE_PIECE):
        end = min(start + REFERENCE_PIECE, len(tokens) - 1)
        model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(tokens) :].tolist()


def converse(engine: LLMEngine, turns: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """Each turn appended to the conversation so far (and the answer to it); the answers, the
    most bytes of KV held at once (blocks taken for a step, before it gives any back: the
    conversation is all the engine holds) and the conversation's length."""
    tokens: list[int] = []
    answers = []
    bm = engine.block_manager
    for i, turn in enumerate(turns):
        tokens = tokens + turn
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        seq = engine.add_request(f"turn-{i}", tokens, params)
        answer = []
        while engine.has_unfinished():
            for out in engine.step():
                answer += out.token_ids
            if not seq.is_finished:
                bm.check_invariants([seq], max_chunk_tokens=engine.config.max_batch_tokens)
        answers.append(answer)
        tokens = tokens + answer
    return answers, bm.most_used * engine.runner.pool.block_nbytes, len(tokens)


def test_gemma3_holds_its_windows_and_its_global_layer():
    window, context = 1024, 16384
    model = windowed_model(
        "gemma3_text", window, ["sliding_attention"] * 5 + ["full_attention"], context
    )
    rng = random.Random(3)
    turns = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (14000, 1996)]
    engine = LLMEngine(
        model, EngineConfig(max_batch_size=4, max_model_len=context), eos_token_ids=set()
    )
    answers, held, length = converse(engine, turns)
    assert engine.block_manager.prefix_hits >= 14000  # the second turn from the cache
    model.set_attn_implementation("sdpa")  # the engine set llmq's on this model's config
    conversation = turns[0] + answers[0] + turns[1]
    assert len(conversation) == 16000
    assert answers[1] == reference(model, conversation)

    layer_token = engine.runner.pool.block_nbytes // engine.config.block_size  # a layer's
    bound = (1 * length + 5 * window) * layer_token
    assert length == 16000 + NEW_TOKENS and held <= 1.2 * bound, (held, bound)
    assert held * 4 < 6 * length * layer_token  # every layer's context: over 4x as much


def test_windowed_mistral_holds_its_window():
    window = 256
    model = windowed_model("mistral_window", window, None, 4096)
    rng = random.Random(5)
    turns = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (2500, 500)]
    engine = LLMEngine(
        model,
        EngineConfig(max_batch_size=4, max_model_len=4096, max_batch_tokens=64),
        eos_token_ids=set(),
    )
    answers, held, length = converse(engine, turns)
    assert engine.block_manager.prefix_hits == (2500 + NEW_TOKENS) // 16 * 16  # whole blocks
    model.set_attn_implementation("sdpa")
    assert answers[1] == reference(model, turns[0] + answers[0] + turns[1])
    assert answers[0] == reference(model, turns[0])
    layer_token = engine.runner.pool.block_nbytes // (engine.config.block_size * 2)  # 2 layers
    # The window, the block it starts in and a step's 64 new tokens: under 1.4x the window.
    assert held <= 1.4 * 2 * window * layer_token, (held, length)
