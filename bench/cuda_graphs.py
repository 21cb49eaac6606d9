"""Decode steps from CUDA graphs against eager ones, side by side in one run (needs a CUDA GPU).

    python bench/cuda_graphs.py [--dtype bfloat16] [--streams 1,8,64] [--output-tokens 128]

Builds (once) the SmolLM2-135M-shaped random model, then for each stream count runs that many
128-token prompts to --output-tokens tokens each through one LLMEngine with graphs on and one
with them off, taking turns (eager, graphs, eager, graphs), and prints output tokens/s of each
and their ratio. The graphs' first use of each shape (capture) is inside a warm-up run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmq.common.sampling_params import SamplingParams  # noqa: E402
from llmq.tools.model_factory import make_model  # noqa: E402
from llmq.worker.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from llmq.worker.loading.model_loader import load_causal_lm  # noqa: E402


def timed(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    return sum(map(len, out)) / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench/out/models/smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="bench/out/cuda_graphs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    if not (Path(args.model) / "config.json").exists():
        make_model(args.model, "llama", "smollm2-135m")
    streams = [int(s) for s in args.streams.split(",")]
    engines = {
        name: LLMEngine(
            load_causal_lm(args.model, args.dtype, "cuda"),
            EngineConfig(max_batch_size=max(streams), cuda_graphs=graphs, max_batch_tokens=8192),
        )
        for name, graphs in (("eager", False), ("graphs", True))
    }
    vocab = engines["eager"].vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    print(
        f"{torch.cuda.get_device_name()}, {args.dtype}, 128-token prompts, "
        f"{args.output_tokens} output tokens"
    )
    print(f"{'streams':>8} {'eager tok/s':>12} {'graphs tok/s':>13} {'ratio':>7}")
    report = []
    for n in streams:
        prompts = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(n)]
        for engine in engines.values():  # warm-up: captures this load's shapes
            engine.generate(prompts, params)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                rates[name].append(timed(engine, prompts, params))
        eager, graphs = max(rates["eager"]), max(rates["graphs"])
        print(f"{n:>8} {eager:>12.1f} {graphs:>13.1f} {graphs / eager:>6.2f}x")
        report.append({"streams": n, "eager_tok_s": eager, "graphs_tok_s": graphs})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
