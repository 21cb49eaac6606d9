"""A GGUF model's load as a worker does it (the tokenizer, the model, the forward's weights and
kernels, the first steps), phase by phase from its log, each in a fresh process.

    python bench/gguf_load.py [--trees DIR,DIR] [--rounds N] [FILE.gguf ...]

FILE.gguf: default the real SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M files of
tests/real_models.py. --trees: llmq source trees to load with, taking turns (each round runs
every tree on every file), e.g. two ``git archive`` exports of the commits compared; default
this checkout. The tokenizer is read from llmq's cache (converted first where it is not there;
--tokenizer-caches: a cache folder per tree).
Printed per run: the load phases the worker logs (tokenizer, metadata and config, weights),
the forward's build (weights packed for the kernels), the first steps, and the whole load from
the tokenizer to the first steps done, without the libraries' imports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One worker-like load in a fresh process: imports first (as a worker does at start), then the
# timed part, its log lines as JSON on stderr.
_CHILD = r"""
import json, logging, sys, time
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append((time.monotonic(), record.getMessage()))
logging.basicConfig(level=logging.INFO, handlers=[Keep()])
import torch
from llmq.worker.model_manager import ModelManager, warm_up
ModelManager.warm_imports()
from llmq.common.settings import get_settings
from llmq.worker.service import build_backend, torch_threads
settings = get_settings()
torch.set_num_threads(torch_threads(settings))
started = time.monotonic()
backend, _, _ = build_backend(settings)
built = time.monotonic()
warm_up(backend)
done = time.monotonic()
print(json.dumps({"build": built - started, "load": done - started,
                  "lines": [(t - started, m) for t, m in lines if t >= started]}))
"""


def run(tree: Path, model: Path, tokenizers: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), LLMQ_MODEL=str(model))
    if tokenizers:
        env["LLMQ_TOKENIZER_CACHE_DIR"] = tokenizers
    env.setdefault("LLMQ_TORCH_THREADS", "1")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, cwd=tree, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


_PHASES = {  # the log line's start: the phase it reports
    "load phase: tokenizer": "tokenizer",
    "load phase: metadata and config": "metadata+config",
    "load phase: weights of": "weights",
    "load phase: forward built": "forward build",
    "load phase: first steps": "first steps",
}


def phases(result: dict) -> dict[str, float]:
    """Seconds of each phase from the log lines' figures; the forward's build, where a tree
    logs no line of its own, from the weights' line to the quantizer's."""
    found, weights_at = {}, None
    for at, message in result["lines"]:
        for start, phase in _PHASES.items():
            if message.startswith(start):
                found[phase] = float(re.search(r" in (\d+\.\d+) s", message).group(1))
        if message.startswith("load phase: weights of"):
            weights_at = at
        elif message.startswith("weights quantized") and weights_at is not None:
            found.setdefault("forward build", at - weights_at)
    found["load"] = result["load"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--trees", default=str(ROOT))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--tokenizer-caches",
        default="",
        help="LLMQ_TOKENIZER_CACHE_DIR per tree (comma-separated, as --trees): a tree whose "
        "cache format differs reads its own",
    )
    args = parser.parse_args()
    files = args.files
    if not files:
        sys.path.insert(0, str(ROOT))
        from tests.real_models import gemma3_gguf, smollm2_gguf

        files = [smollm2_gguf(), gemma3_gguf()]
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    caches = dict(zip(trees, args.tokenizer_caches.split(","), strict=False))
    print(f"uptime: {os.getloadavg()}", flush=True)
    for round_ in range(args.rounds):
        for model in files:
            for tree in trees:
                began = time.monotonic()
                result = phases(run(tree, model.resolve(), caches.get(tree)))
                shown = ", ".join(f"{k} {v:.2f} s" for k, v in result.items())
                print(
                    f"round {round_ + 1} {model.name} [{tree.name}]: {shown} "
                    f"(process {time.monotonic() - began:.1f} s, load average "
                    f"{os.getloadavg()[0]:.1f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
