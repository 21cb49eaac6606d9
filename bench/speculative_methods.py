"""Speculative decoding's methods turn about in one process, on SmolLM2-135M-Instruct in
bfloat16: a lone stream's output tokens/s, the share of proposals kept and the tokens a
checking step yields, per workload of ``bench/speculative.py`` and per method (none, prompt
lookup, suffix decoding, a draft model), greedy. Each prompt runs on every engine in turn, so
that all see the same load on a shared host.

    .venv/bin/python bench/speculative_methods.py --tokens 64 --prompts 2
    .venv/bin/python bench/speculative_methods.py --methods off suffix "draft;draft=gguf"

A configuration is ``method;key=value``: ``draft=gguf`` drafts with the Q4_1 GGUF the float
folder was built from, ``draft=self;draft_q=int4`` with the float folder quantized to int4 at
load (SmolLM2-135M has no smaller model with its tokenizer: the same weights, quantized, are
the draft). Suffix decoding keeps each finished request's output: the workload's later prompts
(other questions on the same text) draw on the earlier ones', as a served workload would.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import speculative  # noqa: E402  (beside this file: its workloads)

METHODS = ["off", "ngram", "suffix", "draft;draft=gguf", "draft;draft=self;draft_q=int4"]
WORK = ["code edit", "multi-turn chat", "free writing"]


def engine_for(config: str, folder: str):
    from llmq.common.settings import Settings
    from llmq.worker.service import build_backend

    method, *pairs = config.split(";")
    fields = dict(kv.split("=", 1) for kv in pairs if kv)
    settings = Settings(
        model=folder,
        device="cpu",
        dtype="bfloat16",
        speculative_method=method,
        speculative_tokens=int(fields.get("k", 4)),
        speculative_model=speculative.draft_model(fields.get("draft", ""), folder),
        speculative_quantization=fields.get("draft_q", "none"),
    )
    return build_backend(settings)[0].engine


def lone(engine, prompt, params) -> tuple[int, float, tuple[int, int, int]]:
    """Output tokens after the first, the seconds they took, and the speculation counters'
    growth (verified, proposed, accepted)."""
    before = speculative.spec_counts(engine)
    n, seconds = speculative.lone(engine, prompt, params)
    after = speculative.spec_counts(engine)
    return n, seconds, tuple(a - b for a, b in zip(after, before, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--workloads", nargs="+", default=WORK)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload (of four)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from llmq.common.sampling_params import SamplingParams
    from tests import real_models

    folder = str(real_models.float_folder(real_models.smollm2_gguf()))
    engines = {m: engine_for(m, folder) for m in args.methods}
    loads = speculative.workloads(AutoTokenizer.from_pretrained(folder))
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    for engine in engines.values():  # warm: the first steps build what later ones reuse
        engine.generate([loads["free writing"][0]], SamplingParams(temperature=0, max_tokens=8))
    print("| work | " + " | ".join(args.methods) + " |")
    print("|" + " --- |" * (1 + len(args.methods)))
    for kind in args.workloads:
        totals = {m: [0, 0.0, 0, 0, 0] for m in args.methods}
        for prompt in loads[kind][: args.prompts]:
            for m, engine in engines.items():
                n, seconds, (verified, proposed, accepted) = lone(engine, prompt, params)
                for i, v in enumerate((n, seconds, verified, proposed, accepted)):
                    totals[m][i] += v
        base = totals[args.methods[0]][0] / totals[args.methods[0]][1]
        cells = [kind]
        for m in args.methods:
            n, seconds, verified, proposed, accepted = totals[m]
            cell = f"{n / seconds:.1f}"
            if verified:
                step = (accepted + verified) / verified
                cell += f" ({n / seconds / base:.2f}x; {accepted / max(proposed, 1):.0%}, {step:.2f}/step)"
            cells.append(cell)
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
