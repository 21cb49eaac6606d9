"""The fused C++ step (``kernels/step_layers.cpp``) against the Python layer loop over the same
C++ ops, side by side in one process, for the model forms that reach it: bfloat16 weights,
int8 and int4 weights, LoRA adapters (32 streams over 8, rank 16), a windowed Gemma 3.

Two engines of each form hold the same decoding sequences; one runs every layer in one C++ call,
the other the Python loop (its ``fused_step`` off). They are stepped in turn, one step
apart, and the median decode step of each is reported with their ratio, and the peak RSS.

    .venv/bin/python bench/fused_step.py                  # batches 1 and 32, every form
    .venv/bin/python bench/fused_step.py --forms int4 --batches 1
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_paths import (  # noqa: E402  (bench/, beside this file)
    ensure_model,
    log,
    make_prompts,
    median_steps_in_turn,
)

FORMS = ("bfloat16", "int8", "int4", "lora", "gemma3")


def engine_of(form: str, model_dir: Path, gemma_dir: Path, fused: bool):
    from llmq.worker.llm_engine import EngineConfig, LLMEngine
    from llmq.worker.loading.model_loader import load_causal_lm

    quantization = form if form in ("int8", "int4") else None
    path = gemma_dir if form == "gemma3" else model_dir
    engine = LLMEngine(
        load_causal_lm(str(path), "bfloat16", "cpu", quantization), EngineConfig(max_batch_size=64)
    )
    engine.runner.forward.fused_step &= fused
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The fused C++ step against the Python loop.")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--batches", default="1,32")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    from lora import TARGETS, make_adapters  # bench/lora.py, beside this file

    from llmq.tools.model_factory import make_model
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
            pairs = [(p, loras[i % 8] if form == "lora" else None) for i, p in enumerate(prompts)]
            ms = median_steps_in_turn(engines, dict.fromkeys(engines, pairs), args.steps)
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
