"""How much quantization changes a model: a fixed text (the same tokens for every form) scored
through the model's bf16 weights and through each quantized form, on llmq's forward.

For each form it prints, against the bf16 weights' own next-token distributions: the mean KL
divergence KL(bf16 || form) over the text's positions, the top-1 agreement (how often both pick
the same next token), and the perplexity of the text. The reference computes in float32 on the
checkpoint's bf16 weights (bfloat16 matmuls are emulated on CPUs without AVX512-BF16 and round
more); the quantized forms run as the worker runs them (activations into the kernels in
bfloat16). ``--sensitivity`` quantizes one role at a time to 4 bits (the rest at 8) and prints
the KL each adds: which tensors the int4 plan should keep at 8 bits. ``--kv-cache-dtype int8,fp8``
scores the bf16 weights with each 8-bit KV cache (LLMQ_KV_CACHE_DTYPE): every key and value
quantized per token and head after the rotary embedding and dequantized, as the pool stores them
(``runner/attention/kv_quant.py``; the engine's output equals this simulation, tests/worker/
test_kv_cache_int8.py).

The text: the first ``--tokens`` tokens of Python's own ``textwrap.py`` (the test models'
tokenizer learned from the standard library), also written to bench/out/quant_quality.txt so that
llama.cpp's ``llama-perplexity --kl-divergence`` can score the same text.

    .venv/bin/python bench/quant_quality.py                               # llama-1b shape
    .venv/bin/python bench/quant_quality.py --size smollm2-135m --sensitivity
    .venv/bin/python bench/quant_quality.py --model path/to/folder --tokens 256
    .venv/bin/python bench/quant_quality.py --forms "" --kv-cache-dtype int8,fp8
    .venv/bin/python bench/quant_quality.py --tokens 1024 --ctx 256 --llama-cpp

``--llama-cpp`` adds llama.cpp's rows: ``llama-perplexity --kl-divergence`` of each quantized
GGUF the peer wrote in the model folder (``QUANT=Q8_0 ../shared/peers/llama-cpp.sh DIR`` and
the same with Q4_K_M, once) against its bf16 GGUF, on the same text with ``-c --ctx``; llmq's
rows are then scored at the same positions (``--ctx``: chunks of that many tokens, each its
own context, the second half of each scored). Its KL is to its own bf16 run, ours to
``--reference`` (float32 arithmetic on the bf16 weights, or bfloat16 as llmq serves them).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import os
import platform
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmq.common.model_files import load_tokenizer  # noqa: E402
from llmq.tools.model_factory import make_model  # noqa: E402
from llmq.worker.loading.model_loader import load_causal_lm  # noqa: E402
from llmq.worker.runner import cpu_kernels  # noqa: E402
from llmq.worker.runner.attention.kv_quant import code_dtype, dequantize, quantize  # noqa: E402
from llmq.worker.runner.forward.decoder_forward import DecoderForward  # noqa: E402
from llmq.worker.runner.linear.quantize import (  # noqa: E402
    ROLES,
    only_role_plan,
    quantize_forward,
    quantized_bytes,
)
from llmq.worker.runner.linear.quantized_linear import int_kernel_available  # noqa: E402

OUT = ROOT / "bench" / "out"


def _attend(layer, query, key, value) -> torch.Tensor:
    """Causal attention over the whole text at once (no KV pool): [1, T, Hq, D]."""
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=layer.scaling, enable_gqa=True
    )
    return out.transpose(1, 2)


def _attend_through_cache(codes: torch.dtype, layer, query, key, value) -> torch.Tensor:
    """``_attend`` over keys and values as an 8-bit cache of ``codes`` holds them."""
    key = dequantize(*quantize(key, codes), codes, key.dtype)
    value = dequantize(*quantize(value, codes), codes, value.dtype)
    return _attend(layer, query, key, value)


def text_tokens(tokenizer, count: int) -> list[int]:
    text = inspect.getsource(textwrap)
    ids = tokenizer.encode(text)[:count]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "quant_quality.txt").write_text(tokenizer.decode(ids))
    return ids


def scored_positions(count: int, ctx: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The text's contexts (start, end) and the positions scored: with ``ctx``, chunks of
    ``ctx`` tokens, each a context of its own, scored at its positions ctx/2 to ctx-2 (the
    first half is context only: llama-perplexity's ``-c ctx`` scheme); without, the whole
    text one context, every position but the last scored."""
    if not ctx:
        return [(0, count)], torch.arange(count - 1)
    chunks = [(a, a + ctx) for a in range(0, count - ctx + 1, ctx)]
    scored = [torch.arange(a + ctx // 2, a + ctx - 1) for a, _ in chunks]
    return chunks, torch.cat(scored)


@torch.inference_mode()
def log_probs(
    model_dir: str,
    ids: list[int],
    form,
    kv_cache: str = "auto",
    ctx: int = 0,
    ref="float32",
    device: str = "cpu",
) -> tuple[torch.Tensor, int, float]:
    """Next-token log-probabilities [T, V] of the text through ``form`` (None: the bf16
    weights, computed in ``ref``: float32, or bfloat16 as llmq serves them) and the KV cache
    ``kv_cache`` (auto: the model's dtype), each chunk of ``ctx`` a context (0: one), the
    weights' bytes, and the seconds the forward took."""
    model = load_causal_lm(model_dir, "float32" if form is not None else ref, device)
    forward = DecoderForward(model, pack=False)
    if form is None:
        nbytes = 2 * sum(p.numel() for p in model.parameters())  # as stored (bf16)
    else:
        quantize_forward(forward, form)
        nbytes = quantized_bytes(forward)
    start = time.perf_counter()
    codes = code_dtype(kv_cache)
    attend = _attend if codes is None else functools.partial(_attend_through_cache, codes)
    chunks, _ = scored_positions(len(ids), ctx)
    logits = [
        forward.run(
            torch.tensor(ids[a:b], device=device), torch.arange(b - a, device=device), None, attend
        ).float()
        for a, b in chunks
    ]
    logits = torch.cat(logits).cpu()
    return torch.log_softmax(logits, dim=-1), nbytes, time.perf_counter() - start


def score(ref: torch.Tensor, got: torch.Tensor, ids: list[int], ctx: int = 0) -> dict[str, float]:
    """KL(ref || got), top-1 agreement and perplexity over the scored positions."""
    _, positions = scored_positions(len(ids), ctx)
    ref, got = ref[positions], got[positions]
    kl = (ref.exp() * (ref - got)).sum(-1)
    following = torch.tensor(ids)[positions + 1]
    nll = -got.gather(1, following[:, None]).mean()
    return {
        "kl": float(kl.mean()),
        "kl_p99": float(kl.quantile(0.99)),
        "top1": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        "ppl": math.exp(float(nll)),
    }


# Where ../shared/peers/llama-cpp.sh builds llama.cpp (it honours PEER_VENVS too).
PEERS = Path(os.environ.get("PEER_VENVS") or Path.home() / ".cache/llmq-peers")
LLAMA_CPP_BUILD = PEERS / "llama-cpp/src/llama.cpp/build"
LLAMA_CPP_BIN = LLAMA_CPP_BUILD / "bin"
_KLD_FIELDS = {
    "kl": r"Mean\s+KLD:\s+([\d.]+)",
    "kl_p99": r"99\.0%\s+KLD:\s+([\d.]+)",
    "top1": r"Same top p:\s+([\d.]+)",
    "ppl": r"Mean PPL\(Q\)\s+:\s+([\d.]+)",
}


def llama_cpp_rows(model_dir: str, ctx: int) -> list[tuple[str, int, dict[str, float]]]:
    """llama-perplexity's KL divergence of each quantized GGUF in ``model_dir`` (written by
    ``QUANT=... ../shared/peers/llama-cpp.sh``: ``.llama-cpp-<type>.gguf``) to its bf16 GGUF,
    on the text this bench wrote, with ``-c ctx``: (name, file bytes, figures)."""
    folder = Path(model_dir)
    base_gguf = folder / ".llama-cpp-bf16.gguf"
    if not LLAMA_CPP_BUILD.is_dir() or not base_gguf.exists():
        print("llama.cpp: not built, or no bf16 GGUF here (run the peer once)", file=sys.stderr)
        return []
    if not (LLAMA_CPP_BIN / "llama-perplexity").exists():  # the peer builds the server alone
        subprocess.run(["ninja", "-C", str(LLAMA_CPP_BUILD), "llama-perplexity"], check=True)
    env = {**os.environ, "LD_LIBRARY_PATH": str(LLAMA_CPP_BIN)}
    text, base = OUT / "quant_quality.txt", OUT / "quant_quality.kld"

    def perplexity(gguf: Path, *extra: str) -> str:
        cmd = [str(LLAMA_CPP_BIN / "llama-perplexity"), "-m", str(gguf), "-f", str(text)]
        cmd += ["-c", str(ctx), "-b", str(ctx), "--kl-divergence-base", str(base), *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode < 0:  # killed by a signal
            # llama.cpp's AMX matmul (its weights repacked for AMX) segfaults on quantized
            # GGUFs on a Sapphire Rapids host; without the repack its other kernels serve (the
            # same quantized weights: the KL is the format's).
            print(f"llama.cpp: {gguf.name} crashed ({done.returncode}); again without repack")
            retry = {**env, "LLAMA_ARG_REPACK": "false"}
            done = subprocess.run(cmd, env=retry, capture_output=True, text=True)
        done.check_returncode()
        return done.stdout + done.stderr

    perplexity(base_gguf)
    rows = []
    for gguf in sorted(folder.glob(".llama-cpp-*.gguf")):
        if gguf == base_gguf:
            continue
        log = perplexity(gguf, "--kl-divergence")
        figures = {k: float(re.search(rx, log).group(1)) for k, rx in _KLD_FIELDS.items()}
        figures["top1"] /= 100
        rows.append(
            (f"llama.cpp {gguf.stem.removeprefix('.llama-cpp-')}", gguf.stat().st_size, figures)
        )
    return rows


def _model_dir(args) -> str:
    if args.model:
        return args.model
    path = OUT / "models" / args.size
    if not (path / "config.json").exists():
        print(f"building {args.size} (random weights) in {path}", file=sys.stderr)
        make_model(path, arch="llama", size=args.size)
    return str(path)


def _row(name: str, nbytes: int, s: dict[str, float], seconds: float | None = None) -> str:
    took = "" if seconds is None else f"{seconds:.1f}"
    return (
        f"| {name} | {nbytes / 2**20:.1f} | {s['kl']:.5f} | {s['kl_p99']:.4f} "
        f"| {s['top1']:.4f} | {s['ppl']:.3f} | {took} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model folder (default: a random llama of --size)")
    p.add_argument("--size", default="llama-1b", help="llmq make-model size when no --model")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--ctx", type=int, default=0, help="contexts of this many tokens (0: one)")
    p.add_argument("--reference", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--llama-cpp", action="store_true", help="score the peer's GGUFs too")
    p.add_argument("--forms", default="int8,int4")
    p.add_argument(
        "--torch-kernels",
        action="store_true",
        help="the forms on torch's kernels (W8A16, W4A16), not llmq's VNNI ones (W8A8, W4A8)",
    )
    p.add_argument("--sensitivity", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the forms on the GPU's kernels")
    p.add_argument(
        "--checkpoint",
        default="",
        help="a quantized checkpoint of the model's weights (bench/write_gptq.py) to score too",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="",
        help="8-bit KV caches to score, e.g. int8,fp8 (bf16 weights)",
    )
    args = p.parse_args()
    if not args.torch_kernels and args.device == "cpu":
        cpu_kernels.load()
    kernels = "llmq's (W8A8, W4A8)" if int_kernel_available() else "torch's (W8A16, W4A16)"
    if args.device != "cpu":
        kernels = f"{args.device}'s (tinygemm W4A16, int8 and fp8 W8A8)"
    model_dir = _model_dir(args)
    ids = text_tokens(load_tokenizer(model_dir), args.tokens)
    print(f"{model_dir}: {len(ids)} tokens of textwrap.py; {platform.processor() or 'cpu'}")
    print(f"quantized forms on {kernels} kernels")
    device = args.device
    ref, ref_bytes, seconds = log_probs(
        model_dir, ids, None, ctx=args.ctx, ref=args.reference, device=device
    )
    print("| form | weights MiB | mean KL | KL p99 | top-1 agreement | perplexity | forward s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(_row(f"bf16 ({args.reference})", ref_bytes, score(ref, ref, ids, args.ctx), seconds))
    forms = [(f, f) for f in args.forms.split(",") if f]
    if args.sensitivity:
        forms += [("all 8-bit", lambda i, n, r: 8)]
        forms += [(f"{role} at 4 bits", only_role_plan(role)) for role in ROLES]
    forms = [(name, form, "auto") for name, form in forms]
    if args.checkpoint:
        forms += [(f"checkpoint {Path(args.checkpoint).name}", "checkpoint", "auto")]
    forms += [(f"bf16, {c} KV cache", None, c) for c in args.kv_cache_dtype.split(",") if c]
    for name, form, kv_cache in forms:
        folder = args.checkpoint if form == "checkpoint" else model_dir
        got, nbytes, seconds = log_probs(folder, ids, form, kv_cache, args.ctx, device=device)
        print(_row(name, nbytes, score(ref, got, ids, args.ctx), seconds), flush=True)
    if args.llama_cpp:
        for name, nbytes, figures in llama_cpp_rows(model_dir, args.ctx or len(ids) // 2):
            print(_row(name, nbytes, figures), flush=True)


if __name__ == "__main__":
    main()
