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
(``runner/kv_quant.py``; the engine's output equals this simulation, tests/worker/
test_kv_cache_int8.py).

The text: the first ``--tokens`` tokens of Python's own ``textwrap.py`` (the test models'
tokenizer learned from the standard library), also written to bench/out/quant_quality.txt so that
llama.cpp's ``llama-perplexity --kl-divergence`` can score the same text.

    .venv/bin/python bench/quant_quality.py                               # llama-1b shape
    .venv/bin/python bench/quant_quality.py --size smollm2-135m --sensitivity
    .venv/bin/python bench/quant_quality.py --model path/to/folder --tokens 256
    .venv/bin/python bench/quant_quality.py --forms "" --kv-cache-dtype int8,fp8
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import platform
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmq.common.model_factory import make_model  # noqa: E402
from llmq.common.model_loader import load_causal_lm, load_tokenizer  # noqa: E402
from llmq.worker.runner.decoder_forward import DecoderForward  # noqa: E402
from llmq.worker.runner.kv_quant import code_dtype, dequantize, quantize  # noqa: E402
from llmq.worker.runner.quantize import (  # noqa: E402
    ROLES,
    only_role_plan,
    quantize_forward,
    quantized_bytes,
)

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


@torch.inference_mode()
def log_probs(
    model_dir: str, ids: list[int], form, kv_cache: str = "auto"
) -> tuple[torch.Tensor, int, float]:
    """Next-token log-probabilities [T, V] of the text through ``form`` (None: the bf16
    weights) and the KV cache ``kv_cache`` (auto: the model's dtype), the weights' bytes, and
    the seconds the forward took."""
    model = load_causal_lm(model_dir, "float32", "cpu")
    forward = DecoderForward(model, pack=False)
    if form is None:
        nbytes = 2 * sum(p.numel() for p in model.parameters())  # as stored (bf16)
    else:
        quantize_forward(forward, form)
        nbytes = quantized_bytes(forward)
    tokens = torch.tensor(ids)
    start = time.perf_counter()
    codes = code_dtype(kv_cache)
    attend = _attend if codes is None else functools.partial(_attend_through_cache, codes)
    logits = forward.run(tokens, torch.arange(len(ids)), None, attend)
    return torch.log_softmax(logits.float(), dim=-1), nbytes, time.perf_counter() - start


def score(ref: torch.Tensor, got: torch.Tensor, ids: list[int]) -> dict[str, float]:
    kl = (ref.exp() * (ref - got)).sum(-1)
    following = torch.tensor(ids[1:])
    nll = -got[:-1].gather(1, following[:, None]).mean()
    return {
        "kl": float(kl.mean()),
        "kl_p99": float(kl.quantile(0.99)),
        "top1": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        "ppl": math.exp(float(nll)),
    }


def _model_dir(args) -> str:
    if args.model:
        return args.model
    path = OUT / "models" / args.size
    if not (path / "config.json").exists():
        print(f"building {args.size} (random weights) in {path}", file=sys.stderr)
        make_model(path, arch="llama", size=args.size)
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model folder (default: a random llama of --size)")
    p.add_argument("--size", default="llama-1b", help="llmq make-model size when no --model")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--forms", default="int8,int4")
    p.add_argument("--sensitivity", action="store_true")
    p.add_argument(
        "--kv-cache-dtype",
        default="",
        help="8-bit KV caches to score, e.g. int8,fp8 (bf16 weights)",
    )
    args = p.parse_args()
    model_dir = _model_dir(args)
    ids = text_tokens(load_tokenizer(model_dir), args.tokens)
    print(f"{model_dir}: {len(ids)} tokens of textwrap.py; {platform.processor() or 'cpu'}")
    ref, ref_bytes, seconds = log_probs(model_dir, ids, None)
    base = score(ref, ref, ids)
    print("| form | weights MiB | mean KL | KL p99 | top-1 agreement | perplexity | forward s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| bf16 | {ref_bytes / 2**20:.1f} | 0 | 0 | 1 | {base['ppl']:.3f} | {seconds:.1f} |")
    forms = [(f, f) for f in args.forms.split(",") if f]
    if args.sensitivity:
        forms += [("all 8-bit", lambda i, n, r: 8)]
        forms += [(f"{role} at 4 bits", only_role_plan(role)) for role in ROLES]
    forms = [(name, form, "auto") for name, form in forms]
    forms += [(f"bf16, {c} KV cache", None, c) for c in args.kv_cache_dtype.split(",") if c]
    for name, form, kv_cache in forms:
        got, nbytes, seconds = log_probs(model_dir, ids, form, kv_cache)
        s = score(ref, got, ids)
        print(
            f"| {name} | {nbytes / 2**20:.1f} | {s['kl']:.5f} | {s['kl_p99']:.4f} "
            f"| {s['top1']:.4f} | {s['ppl']:.3f} | {seconds:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
