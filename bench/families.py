"""One decode step of llmq's engine per model family, side by side: the Llama, Qwen 3 and Gemma 3
shapes of SmolLM2-135M's size (``llmq make-model --arch ... --size smollm2-135m``), in process.

Each family's engine holds ``batch`` sequences of ``context`` prompt tokens, all decoding; the
rounds then time ``steps`` engine steps of each family in turn (the order rotated every round,
so the machine's load falls on all alike), and report the median step, the step per parameter
and each family's speed per parameter as a ratio to the Llama shape's (1.0: as fast per
parameter; the target for Qwen 3 and Gemma 3 is at least 0.9), and the process's peak RSS. The
path each engine takes is printed with it (llmq's forward or transformers', and how many of its
timed steps ran every layer in one C++ call).

    .venv/bin/python bench/families.py                         # bfloat16 and float32, batch 1, 32
    .venv/bin/python bench/families.py --dtypes bfloat16 --batches 1 --rounds 3
    .venv/bin/python bench/families.py --context 700           # past Gemma 3's 512-token window
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import time
from pathlib import Path

from engine_paths import cores, load, log, make_prompts

FAMILIES = ("llama", "qwen3", "gemma3")


def ensure(root: Path, arch: str) -> Path:
    path = root / f"{arch}-smollm2-135m"
    if not (path / "config.json").exists():
        from llmq.tools.model_factory import make_model

        log(f"building the smollm2-135m-shaped {arch} model in {path}")
        make_model(path, arch=arch, size="smollm2-135m")
    return path


class Timed:
    """A family's engine with ``batch`` sequences decoding, and its timed steps."""

    def __init__(self, path: Path, dtype: str, batch: int, context: int, max_tokens: int):
        from llmq.common.sampling_params import SamplingParams
        from llmq.worker.llm_engine import EngineConfig, LLMEngine

        model = load(path, dtype)
        self.params = sum(p.numel() for p in model.parameters())
        config = EngineConfig(max_batch_size=batch, max_batch_tokens=max(512, context))
        self.engine = LLMEngine(model, config)
        forward = self.engine.runner.forward
        self.path = "llmq" if forward is not None else "transformers"
        self.cpp_steps = 0
        if forward is not None:
            in_cpp = forward._step_in_cpp

            def counted(*args):
                self.cpp_steps += 1
                return in_cpp(*args)

            forward._step_in_cpp = counted
        vocab = model.config.get_text_config().vocab_size
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(make_prompts(batch, context, context, vocab, seed=1)):
            self.engine.add_request(str(i), prompt, params)
        while self.engine.scheduler.waiting or any(
            not s.output_token_ids for s in self.engine.scheduler.running
        ):
            self.engine.step()  # prefill until every sequence decodes
        self.cpp_steps = 0
        self.times: list[float] = []

    def run(self, steps: int) -> None:
        for _ in range(steps):
            start = time.perf_counter()
            self.engine.step()
            self.times.append(time.perf_counter() - start)


def measure(args, paths: dict[str, Path], dtype: str, batch: int) -> dict:
    timed = {
        arch: Timed(path, dtype, batch, args.context, args.steps * args.rounds + 8)
        for arch, path in paths.items()
    }
    order = list(timed)
    for r in range(args.rounds):
        for arch in order[r % len(order) :] + order[: r % len(order)]:
            timed[arch].run(args.steps)
    out = {}
    for arch, t in timed.items():
        step = statistics.median(t.times)
        out[arch] = {
            "path": t.path,
            "steps_in_one_cpp_call": f"{t.cpp_steps}/{len(t.times)}",
            "params_m": round(t.params / 1e6, 2),
            "step_ms": round(step * 1e3, 2),
            "ns_per_param": round(step / t.params * 1e9, 4),
        }
    base = out["llama"]["ns_per_param"]
    for arch in out:
        out[arch]["speed_per_param_vs_llama"] = round(base / out[arch]["ns_per_param"], 3)
    del timed
    gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("/tmp/llmq-bench-families"))
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6, help="steps per family per round")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    paths = {arch: ensure(args.root, arch) for arch in FAMILIES}
    results = {}
    for dtype in args.dtypes.split(","):
        for batch in map(int, args.batches.split(",")):
            log(f"{dtype}, batch {batch}, context {args.context}")
            results[f"{dtype} batch {batch}"] = figures = measure(args, paths, dtype, batch)
            for arch, f in figures.items():
                log(f"  {arch:7s} {json.dumps(f)}")
    summary = {
        "cpu": _cpu_model(),
        "cores": cores(),
        "threads": args.threads,
        "context": args.context,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "results": results,
    }
    print(json.dumps(summary, indent=1))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
