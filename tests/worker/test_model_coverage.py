"""Every architecture llmq serves gives ``generate``'s greedy tokens, or is refused by name.

Tiny random models of each architecture (``llmq/tools/model_archs.py``: 2 layers, hidden 64,
sliding windows of 8 tokens, Gemma 2's softcapping, gpt-oss's sinks, DeepSeek's MLA; norms,
biases and sinks perturbed) are written by ``make_model`` and loaded as any folder is, then
served in float32 by ``LLMEngine``: the longest prompt alone, four at once in chunks of 24 tokens and
again from the prefix cache, and in a pool so small that sequences are preempted. Prompts of 5,
40, 200 and 120 tokens (the last sharing the 200's first 100) cross every window.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmq.common.sampling_params import SamplingParams
from llmq.tools.model_archs import ARCHS
from llmq.tools.model_factory import make_model
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner.forward.decoder_forward import DecoderForward, supports
from llmq.worker.runner.forward.model_support import UnsupportedModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 24
# llmq's own forward (``decoder_forward``); the rest: transformers'.
FAST_FORWARD = {"llama", "qwen2", "mistral", "mistral_window", "qwen3", "phi3", "gemma2"}
FAST_FORWARD |= {"gemma3_text", "qwen3_moe", "mixtral"}
# A pool that preempts and holds the longest prompt: a windowed model's block holds a KV group's
# layers (one of two, alternating), and its window's (8 tokens) layers take a few blocks alone.
TIGHT_BLOCKS = {"mistral_window": 6, "gemma2": 22, "gemma3_text": 22, "gpt_oss": 22}


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (5, 40, 200)]
    prompts.append(prompts[2][:100] + [rng.randrange(3, vocab_size) for _ in range(20)])
    return prompts


def generate(model, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def load(path, **overrides):
    """The float32 model of ``path``, its config changed by ``overrides`` before the modules
    are built (they read it once)."""
    if not overrides:
        return load_causal_lm(str(path), "float32", "cpu")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **overrides).eval()


def references(path, **overrides) -> list[list[int]]:
    model = load(path, **overrides)
    with torch.inference_mode():
        return [generate(model, p) for p in make_prompts(model.config.vocab_size)]


def serve(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    results: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        engine.add_request(f"{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id].extend(out.token_ids)
    return [results[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    built: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in built:
            path = make_model(root / arch, arch=arch)
            built[arch] = (path, references(path))
        return built[arch]

    return get


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_output_equals_generate(arch_models, arch):
    path, expected = arch_models(arch)
    prompts = make_prompts(load_vocab(path))
    assert all(len(set(t)) >= NEW_TOKENS // 3 for t in expected), expected
    assert len(set().union(*expected)) >= 40  # varied: an ignored feature would show

    def engine(**config) -> LLMEngine:
        model = load(path)
        return LLMEngine(model, EngineConfig(**config), eos_token_ids=set())

    alone = engine(num_blocks=64, max_batch_size=1)  # the longest prompt, on its own
    assert serve(alone, prompts[2:3]) == expected[2:3]
    assert supports(load(path)) == (arch in FAST_FORWARD)
    assert isinstance(alone.runner.forward, DecoderForward) == (arch in FAST_FORWARD)

    batched = engine(num_blocks=128, max_batch_tokens=24)  # chunked prefills beside decodes
    assert serve(batched, prompts) == expected
    assert serve(batched, prompts) == expected  # again, from the prefix cache
    assert batched.block_manager.prefix_hits >= 200

    tight = engine(num_blocks=TIGHT_BLOCKS.get(arch, 16), max_batch_tokens=64)
    assert serve(tight, prompts) == expected
    assert tight.scheduler.num_preemptions > 0


def load_vocab(path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path)).get_text_config().vocab_size


# Each feature switched off in the same weights: the reference changes, so ignoring it fails.
FEATURE_OFF = {
    "mistral_window": {"sliding_window": None},
    "gemma2": {"attn_logit_softcapping": None},
    "gemma3_text": {"sliding_window": 4096},
    "gpt_oss": {"sliding_window": 4096},
}


@pytest.mark.parametrize("arch", list(FEATURE_OFF))
def test_each_feature_changes_the_output(arch_models, arch):
    path, expected = arch_models(arch)
    assert references(path, **FEATURE_OFF[arch]) != expected


def test_a_window_covering_the_whole_context_is_no_window(arch_models):
    """gemma3 with a window of 4096 and a context of 2048: no window masks, and exact."""
    path, _ = arch_models("gemma3_text")
    expected = references(path, sliding_window=4096)
    model = load(path, sliding_window=4096)
    engine = LLMEngine(model, EngineConfig(num_blocks=128), eos_token_ids=set())
    assert engine.runner.windows == frozenset()
    assert engine.max_model_len == 2048
    assert serve(engine, make_prompts(model.config.vocab_size)) == expected


def test_a_feature_llmq_lacks_is_refused_by_name(arch_models):
    """Chunked attention (Llama 4's ``attention_chunk_size``) reaches only the mask, which the
    paged attention never sees: the engine refuses the model, naming it."""
    path, _ = arch_models("llama")
    model = load(path)
    model.config.attention_chunk_size = 8
    with pytest.raises(UnsupportedModel, match=r"chunked attention \(attention_chunk_size=8\)"):
        LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids=set())


def test_a_window_only_the_mask_knows_is_refused(arch_models):
    """A config whose layers are windowed in the mask but whose attention call carries no
    ``sliding_window`` (here: Llama's, which never passes one) is refused, not served wrong."""
    path, _ = arch_models("llama")
    model = load(path)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    model.config.sliding_window = 8
    with pytest.raises(UnsupportedModel, match="sliding window of 8 in layer 0"):
        LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids=set())
