"""The fused C++ step (``kernels/step_layers.cpp``) against the Python layer loop over the same
C++ ops, side by side in one process, for the model forms that reach it: bfloat16 weights,
int8 and int4 weights, LoRA adapters (32 streams over 8, rank 16), a windowed Gemma 3.

Two engines of each form hold the same decoding sequences; one runs every layer in one C++ call,
the other the Python loop (its ``_uniform_layers`` off). They are stepped in turn, one step
apart, and the median decode step of each is reported with their ratio, and the peak RSS.

    .venv/bin/python bench/fused_step.py                  # batches 1 and 32, every form
    .venv/bin/python bench/fused_step.py --forms int4 --batches 1
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_paths import ensure_model, log, make_prompts  # noqa: E402  (bench/, beside this file)

FORMS = ("bfloat16", "int8", "int4", "lora", "gemma3")


def engine_of(form: str, model_dir: Path, gemma_dir: Path, fused: bool):
    from llmq.common.model_loader import load_causal_lm
    from llmq.worker.llm_engine import EngineConfig, LLMEngine

    quantization = form if form in ("int8", "int4") else None
    path = gemma_dir if form == "gemma3" else model_dir
    engine = LLMEngine(
        load_causal_lm(str(path), "bfloat16", "cpu", quantization), EngineConfig(max_batch_size=64)
    )
    engine.runner.forward._uniform_layers &= fused
    return engine


def median_steps(engines: dict, prompts, loras, steps: int) -> dict[str, float]:
    from llmq.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for engine in engines.values():
        for i, p in enumerate(prompts):
            lora = loras[i % len(loras)] if loras else None
            engine.add_request(f"s{i}", p, params, lora=lora)
        while engine.has_unfinished() and any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()
        ):
            engine.step()
        engine.step()
    times: dict[str, list[float]] = {kind: [] for kind in engines}
    for _ in range(steps):
        for kind, engine in engines.items():
            t = time.perf_counter()
            engine.step()
            times[kind].append(time.perf_counter() - t)
    return {kind: statistics.median(ts) * 1000 for kind, ts in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The fused C++ step against the Python loop.")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--batches", default="1,32")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    from lora import TARGETS, make_adapters  # bench/lora.py, beside this file

    from llmq.common.model_factory import make_model
    from llmq.worker.engine.sequence import LoraRef

    model_dir = ensure_model(ROOT / "bench/out/models/smollm2-135m")
    gemma_dir = ROOT / "bench/out/models/gemma3-135m"
    if not (gemma_dir / "config.json").exists():
        make_model(gemma_dir, arch="gemma3", size="smollm2-135m")
    folders = make_adapters(model_dir, ROOT / "bench/out/loras", 9, 16, list(TARGETS))
    loras = [LoraRef(f.name, str(f)) for f in folders[:8]]
    for form in args.forms.split(","):
        for batch in map(int, args.batches.split(",")):
            engines = {
                kind: engine_of(form, model_dir, gemma_dir, kind == "fused")
                for kind in ("fused", "loop")
            }
            prompts = make_prompts(batch, 128, 128, engines["fused"].vocab_size, seed=1)
            ms = median_steps(engines, prompts, loras if form == "lora" else [], args.steps)
            log(
                f"{form:8s} batch {batch:2d}: fused {ms['fused']:6.1f} ms, Python loop "
                f"{ms['loop']:6.1f} ms: {ms['loop'] / ms['fused']:.2f}x"
            )
            del engines
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
