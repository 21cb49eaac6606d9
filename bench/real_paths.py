"""The engine's paths on a real model, each against transformers' float32 model of the same
weights: greedy token ids and perplexity.

Each configuration (``key=value;...``: Settings fields, ``form=float|gguf|int8|int4``, and
``short=1`` for the four short prompts alone, no perplexity) builds the engine a worker builds
(``build_backend``) and runs: the perplexity of ~800 tokens of ``tests/data/
scandal_in_bohemia.txt`` from its prompt logprobs; then six prompts at once, greedy, 24 tokens
(four short ones, two of ~560 tokens of the text before a question: past Gemma 3's 512-token
window as they decode), twice (the second round from the prefix cache). A prompt's mark is ``=``
where every token equals transformers' greedy ``generate``, else ``xK(gap G)``: its first
differing token and the reference's top-2 log-probability gap there (a near tie when small).

    .venv/bin/python bench/real_paths.py smollm2 "" "cpu_kernels=false" "kv_cache_dtype=int8"
    .venv/bin/python bench/real_paths.py gemma3 "short=1;kv_blocks=12" "max_batch_tokens=64"
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NEW_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]
OPENINGS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village",
    "The three primary colors are",
]


def prompts(name: str, tok, text: list[int]) -> list[list[int]]:
    if name == "smollm2":
        short = [
            list(
                tok.apply_chat_template(
                    [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                    return_dict=False,
                )
            )
            for q in QUESTIONS
        ]  # fmt: skip
    else:
        short = [tok.encode(t) for t in OPENINGS]
    return short + [text[:560] + short[0][1:], text[:560] + short[1][1:]]


@torch.inference_mode()
def reference(folder: Path, text: list[int], batch: list[list[int]]) -> tuple[float, list]:
    """The float32 model's perplexity of ``text`` and, per prompt, its greedy tokens and the
    top-2 gap before each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logp = model(torch.tensor([text])).logits[0, :-1].log_softmax(-1)
    ppl = math.exp(float(-logp.gather(1, torch.tensor(text[1:])[:, None]).mean()))
    answers = []
    for p in batch:
        out = model.generate(
            torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, len(p) :].tolist()  # fmt: skip
        top = model(torch.tensor([p + out])).logits[0, len(p) - 1 :].log_softmax(-1).topk(2)
        answers.append((out, (top.values[:, 0] - top.values[:, 1]).tolist()))
    return ppl, answers


def run(config: dict, files: tuple[Path, Path], text: list[int], batch, answers) -> str:
    from llmq.common.sampling_params import SamplingParams
    from llmq.common.settings import Settings
    from llmq.worker.service import build_backend

    form, short = config.pop("form", "float"), config.pop("short", None)
    quant = form if form in ("int8", "int4") else "none"
    path = files[0] if form == "gguf" else files[1]
    settings = Settings(model=str(path), device="cpu", quantization=quant, **config)
    engine = build_backend(settings)[0].engine
    ppl = float("nan")
    if not short:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        engine.add_request("ppl", text, params)
        rows = []
        while engine.has_unfinished():
            rows += [r for out in engine.step() for r in out.prompt_logprobs or []]
        ppl = math.exp(-sum(e["logprob"] for e in rows[1:]) / (len(rows) - 1))
    use = batch[:4] if short else batch
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    marks = []
    for _ in range(2):  # the second round from the prefix cache
        for got, (want, gaps) in zip(engine.generate(use, params), answers, strict=False):
            if len(got) < NEW_TOKENS:  # ended at the context the pool gives (LLMQ_KV_BLOCKS)
                marks.append(f"ended at {len(got)}")
                continue
            k = next((j for j in range(NEW_TOKENS) if got[j] != want[j]), None)
            marks.append("=" if k is None else f"x{k}(gap {gaps[k]:.2f})")
    return (
        f"ppl {ppl:.4f}, greedy {' '.join(marks)}, preemptions {engine.scheduler.num_preemptions}"
    )


def main() -> None:
    from transformers import AutoTokenizer

    from tests import real_models

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=["smollm2", "gemma3"])
    parser.add_argument("configs", nargs="*", help="key=value;... each (Settings fields, form)")
    args = parser.parse_args()
    name, configs = args.model, args.configs or [""]
    torch.set_num_threads(1)  # as the test suite's workers run (LLMQ_TORCH_THREADS=1)
    gguf = real_models.smollm2_gguf() if name == "smollm2" else real_models.gemma3_gguf()
    files = (gguf, real_models.float_folder(gguf))
    tok = AutoTokenizer.from_pretrained(files[1])
    paragraphs = (ROOT / "tests/data/scandal_in_bohemia.txt").read_text().split("\n\n")
    text = tok.encode("\n\n".join(paragraphs[:4]))
    batch = prompts(name, tok, text)
    ref_ppl, answers = reference(files[1], text, batch)
    print(f"{name}: float32 reference ppl {ref_ppl:.4f}", flush=True)
    for spec in configs:
        config = dict(kv.split("=", 1) for kv in spec.split(";") if kv)
        start = time.perf_counter()
        line = run(dict(config), files, text, batch, answers)
        print(f"{spec or 'defaults'}: {line} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
