"""Speculation is lossless on real models in bfloat16: SmolLM2-135M-Instruct's greedy tokens
with prompt lookup equal its tokens without, batched, on the prompts `llmq bench` runs; and
Gemma 3 270M's, whose sliding layers (a window of 512) give back the blocks a rejected draft took
in every KV group, past its window.

In bfloat16 two kernels that sum in different orders part at the model's near ties: a checking
step's rows must each be computed as a plain decode of its position is (the decode kernel over
its own context), not as a prompt chunk (SDPA over a gathered context and a mask), which
parted on 11 of 20 of these prompts within 17 to 105 tokens."""

from __future__ import annotations

import pytest

from llmq.common.sampling_params import SamplingParams
from llmq.common.settings import Settings
from llmq.tools.bench_workloads import workload_chats
from llmq.worker.service import build_backend
from tests import real_models

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smollm2() -> str:
    return str(real_models.float_folder(real_models.smollm2_gguf()))


@pytest.fixture(scope="module")
def gemma3() -> str:
    return str(real_models.float_folder(real_models.gemma3_gguf()))


def _prompts(folder: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    chats = dict(workload_chats().values())
    picked = chats["JSON extraction"] + chats["free writing"][:2]
    return [
        tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in picked
    ]


def _greedy(
    folder: str, method: str, prompts: list[list[int]], tokens: int = 48
) -> tuple[list[list[int]], int]:
    settings = Settings(model=folder, device="cpu", dtype="bfloat16", speculative_method=method)
    settings.speculative_max_batch = len(prompts)  # every step of the batch checks drafts
    engine = build_backend(settings)[0].engine
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens))
    accepted = engine.speculator.stats.accepted if engine.speculator is not None else 0
    return [list(o) for o in outs], accepted


def test_prompt_lookup_gives_the_tokens_of_plain_decoding_in_bfloat16(smollm2):
    prompts = _prompts(smollm2)
    plain, _ = _greedy(smollm2, "off", prompts)
    speculated, accepted = _greedy(smollm2, "ngram", prompts)
    assert accepted > 20  # drafts were checked and kept
    for i, (a, b) in enumerate(zip(plain, speculated, strict=True)):
        assert a == b, (i, next(j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y))


def test_prompt_lookup_past_a_sliding_window_gives_the_tokens_of_plain_decoding(gemma3):
    """Two documents of ~390 tokens (the base model continues them), 150 tokens each: past the
    512-token window of Gemma 3's sliding layers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3)
    chats = dict(workload_chats().values())["document QA (quotes)"][:2]
    prompts = [tok("\n".join(m["content"] for m in c))["input_ids"] for c in chats]
    assert all(len(p) + 150 > 512 for p in prompts)
    plain, _ = _greedy(gemma3, "off", prompts, 150)
    speculated, accepted = _greedy(gemma3, "ngram", prompts, 150)
    assert accepted > 20
    assert plain == speculated
