"""Quantized weights against bfloat16 on a CUDA GPU, side by side in one run (needs a GPU).

    python bench/gpu_quant.py [--size llama-1b] [--forms bf16,int8,int4,fp8,gptq]
                              [--streams 1,64] [--output-tokens 128]

Builds (once) the random model of ``--size`` and, for ``gptq``, its 4-bit GPTQ checkpoint
(``bench/write_gptq.py``: groups of 128, AutoGPTQ's layout, read by llmq as a downloaded one),
for ``fp8-channel`` and ``fp8-blocks`` its FP8 checkpoints (``bench/write_fp8.py``:
llm-compressor's FP8-dynamic, DeepSeek's and Qwen3's 128 x 128 blocks).
Each form runs in one ``LLMEngine`` with CUDA graphs: int8 (W8A8 on ``torch._int_mm``), int4
(tinygemm's W4A16, Q4_K_M's 8-bit tensors as int8), fp8 (W8A8 on ``torch._scaled_mm``), the
GPTQ checkpoint (tinygemm) and the FP8 checkpoints (``torch._scaled_mm`` row-wise, and
block-scaled on a Hopper GPU). For each stream count it prints output tokens/s (128-token prompts;
the best of ``--rounds`` after a warm-up that captures the graphs), the ratio to bf16, the
weights' bytes and the GPU's peak memory, and how many of the lone stream's greedy tokens
equal bf16's (a random model's greedy text drifts at the first differing logit: a measure of
agreement, not of quality; ``bench/quant_quality.py --device cuda`` measures KL).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cuda_graphs import timed  # noqa: E402
from bench.write_fp8 import write_fp8  # noqa: E402
from bench.write_gptq import write_gptq  # noqa: E402
from llmq.common.sampling_params import SamplingParams  # noqa: E402
from llmq.tools.model_factory import make_model  # noqa: E402
from llmq.worker.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from llmq.worker.loading.model_loader import load_causal_lm  # noqa: E402
from llmq.worker.runner.linear.quantize import quantized_bytes  # noqa: E402

SCHEMES = {"bf16": "none", "int8": "int8", "int4": "int4", "fp8": "fp8"}
# forms read from a checkpoint written from the model: its folder's suffix, its writer
CHECKPOINTS = {
    "gptq": ("gptq", lambda src, dst: write_gptq(src, dst, device="cuda")),
    "fp8-channel": ("fp8-channel", lambda src, dst: write_fp8(src, dst, "channel", "cuda")),
    "fp8-blocks": ("fp8-blocks", lambda src, dst: write_fp8(src, dst, "blocks", "cuda")),
}


def weight_bytes(engine: LLMEngine) -> int:
    forward = engine.runner.forward
    if forward is not None and forward.layout not in ("plain", "panels", "onednn"):
        # the quantized projections, head and table, and what stayed float beside them
        floats = sum(p.nbytes for p in engine.runner.model.parameters())
        return quantized_bytes(forward) + floats
    return sum(p.nbytes for p in engine.runner.model.parameters())


def run_form(folder: str, scheme: str, streams: list[int], args, prompts) -> dict:
    torch.cuda.reset_peak_memory_stats()
    model = load_causal_lm(folder, "bfloat16", "cuda", scheme)
    config = EngineConfig(max_batch_size=max(streams), max_batch_tokens=8192)
    engine = LLMEngine(model, config)
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    row = {"layout": engine.runner.forward.layout, "weights_gb": weight_bytes(engine) / 1e9}
    row["lone_tokens"] = engine.generate(prompts[:1], params)[0]
    for n in streams:
        engine.generate(prompts[:n], params)  # warm-up: captures this load's graphs
        row[f"tok_s_{n}"] = max(timed(engine, prompts[:n], params) for _ in range(args.rounds))
    row["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="llama-1b")
    ap.add_argument("--forms", default="bf16,int8,int4,fp8,gptq")
    ap.add_argument("--streams", default="1,64")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="bench/out/gpu_quant.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    folder = Path(f"bench/out/models/{args.size}")
    if not (folder / "config.json").exists():
        make_model(folder, "llama", args.size, device="cuda")
    streams = [int(s) for s in args.streams.split(",")]
    forms = args.forms.split(",")
    paths = {form: folder for form in forms}
    for form in set(forms) & set(CHECKPOINTS):
        suffix, write = CHECKPOINTS[form]
        paths[form] = folder.parent / f"{args.size}-{suffix}"
        if not (paths[form] / "config.json").exists():
            write(folder, paths[form])
    rng = random.Random(0)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(max(streams))]
    print(f"{torch.cuda.get_device_name()}, {args.size}, 128-token prompts, {args.output_tokens}")
    rows: dict[str, dict] = {}
    for form in forms:
        rows[form] = run_form(str(paths[form]), SCHEMES.get(form, "none"), streams, args, prompts)
        print(form, {k: v for k, v in rows[form].items() if k != "lone_tokens"}, flush=True)
    base = rows.get("bf16")
    heads = " | ".join(f"{n} streams tok/s" for n in streams)
    print(f"| form | layout | weights GB | peak GPU GB | {heads} | lone tokens = bf16's |")
    print("| --- " * (5 + len(streams)) + "|")
    for form, row in rows.items():
        rates = " | ".join(
            f"{row[f'tok_s_{n}']:.0f}"
            + (f" ({row[f'tok_s_{n}'] / base[f'tok_s_{n}']:.2f}x)" if base else "")
            for n in streams
        )
        same = "-"
        if base:
            pairs = zip(row["lone_tokens"], base["lone_tokens"], strict=True)
            same = str(next((i for i, (a, b) in enumerate(pairs) if a != b), args.output_tokens))
        print(
            f"| {form} | {row['layout']} | {row['weights_gb']:.2f} | {row['peak_gpu_gb']:.2f} "
            f"| {rates} | first {same} |"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
