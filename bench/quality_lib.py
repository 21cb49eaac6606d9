"""How close a served form is to the float32 model, position by position: a library the quality
benches and tests call, and a quick command.

``served_log_probs`` runs a model as llmq's worker loads and builds it (a GGUF file as held, a
folder with ``LLMQ_QUANTIZATION``'s form, llmq's integer kernels where they load), over real
English text in contexts of ``ctx`` tokens, scoring each chunk's second half as
``llama-perplexity --kl-divergence`` does; ``reference_log_probs`` runs transformers' own
forward in float32 on a float folder of the same weights. ``compare`` gives the top-1
disagreement (the share of scored positions whose argmax next token differs), the mean KL
divergence and both perplexities.

    .venv/bin/python bench/quality_lib.py smollm2                # the Q4_1 file, as served
    .venv/bin/python bench/quality_lib.py gemma3 --forms gguf,int8,int4
    .venv/bin/python bench/quality_lib.py smollm2 --forms gguf,int8 --dtype float32
    LLMQ_INT_ACTIVATIONS=1 .venv/bin/python bench/quality_lib.py smollm2
    .venv/bin/python bench/quality_lib.py smollm2 --terms-speed  # the file's forward, 1 vs 2 terms
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = ROOT / "tests" / "data" / "scandal_in_bohemia.txt"  # real English prose


def text_ids(tokenizer, count: int = 1024) -> list[int]:
    """The first ``count`` tokens of the text (a BOS first where the tokenizer adds one)."""
    return tokenizer(TEXT.read_text())["input_ids"][:count]


def scored_chunks(count: int, ctx: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """Contexts of ``ctx`` tokens (start, end) and the positions scored: each chunk's
    ctx/2 .. ctx-2 (llama-perplexity's scheme: the first half is context only)."""
    chunks = [(a, a + ctx) for a in range(0, count - ctx + 1, ctx)]
    return chunks, torch.cat([torch.arange(a + ctx // 2, a + ctx - 1) for a, _ in chunks])


def _attend(layer, query, key, value) -> torch.Tensor:
    """Causal attention over a whole chunk (no pool; a chunk fits Gemma 3's window)."""
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=layer.scaling, enable_gqa=True
    )
    return out.transpose(1, 2)


@torch.inference_mode()
def reference_log_probs(folder: Path, ids: list[int], ctx: int = 512) -> torch.Tensor:
    """transformers' float32 forward on ``folder``: log-probabilities [len(ids), V] (rows
    past the last whole chunk zero)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = None
    for a, b in scored_chunks(len(ids), ctx)[0]:
        logits = model(torch.tensor([ids[a:b]])).logits[0].float()
        out = torch.zeros(len(ids), logits.shape[-1]) if out is None else out
        out[a:b] = torch.log_softmax(logits, -1)
    return out


@torch.inference_mode()
def served_log_probs(
    model: str, ids: list[int], ctx: int = 512, quantization: str = "none", dtype: str = "auto"
) -> tuple[torch.Tensor, float]:
    """llmq's forward as the worker builds it for ``model`` (a folder or GGUF file) with
    ``quantization`` and ``dtype`` (``LLMQ_DTYPE``; auto: bfloat16 on a CPU with it in
    hardware, else float32): log-probabilities as ``reference_log_probs``' and the seconds
    taken."""
    from llmq.worker.loading.model_loader import load_causal_lm
    from llmq.worker.runner import cpu_kernels
    from llmq.worker.runner.forward.decoder_forward import build_forward

    kernels = cpu_kernels.load()
    lm = load_causal_lm(str(model), dtype, "cpu", quantization)
    forward = build_forward(lm, True, True, kernels)
    start, out = time.perf_counter(), None
    for a, b in scored_chunks(len(ids), ctx)[0]:
        tokens = torch.tensor(ids[a:b])
        logits = forward.run(tokens, torch.arange(b - a), None, _attend).float()
        out = torch.zeros(len(ids), logits.shape[-1]) if out is None else out
        out[a:b] = torch.log_softmax(logits, -1)
    return out, time.perf_counter() - start


def compare(ref: torch.Tensor, got: torch.Tensor, ids: list[int], ctx: int = 512) -> dict:
    """Top-1 disagreement, mean KL(ref || got) and both perplexities over the scored
    positions."""
    _, at = scored_chunks(len(ids), ctx)
    ref, got = ref[at], got[at]
    following = torch.tensor(ids)[at + 1, None]
    return {
        "positions": len(at),
        "top1_disagreement": float((ref.argmax(-1) != got.argmax(-1)).float().mean()),
        "kl": float((ref.exp() * (ref - got)).sum(-1).mean()),
        "ppl_ref": math.exp(float(-ref.gather(1, following).mean())),
        "ppl": math.exp(float(-got.gather(1, following).mean())),
    }


@torch.inference_mode()
def terms_speed(model: str, rows_list=(1, 16, 64), rounds: int = 5) -> dict:
    """ms of llmq's whole forward over ``rows`` tokens of ``model`` (a GGUF file or folder) with
    the activations in 1 and 2 int8 terms, alternating, the best of ``rounds``."""
    from llmq.worker.loading.model_loader import load_causal_lm
    from llmq.worker.runner import cpu_kernels
    from llmq.worker.runner.forward.decoder_forward import build_forward

    assert cpu_kernels.load(), "llmq's kernels did not build"
    forward = build_forward(load_causal_lm(str(model), "auto", "cpu"), True, True, True)
    best: dict = {}
    for _ in range(rounds):
        for terms in (1, 2):
            before = cpu_kernels.set_activation_terms(terms)
            for rows in rows_list:
                ids, at = torch.arange(100, 100 + rows), torch.arange(rows)
                forward.run(ids, at, at, _attend)
                start = time.perf_counter()
                for _ in range(3):
                    forward.run(ids, at, at, _attend)
                ms = (time.perf_counter() - start) / 3 * 1e3
                best[terms, rows] = min(ms, best.get((terms, rows), float("inf")))
            cpu_kernels.set_activation_terms(before)
    return best


def _files(name: str) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    import real_models

    gguf = real_models.smollm2_gguf() if name == "smollm2" else real_models.gemma3_gguf()
    return gguf, real_models.float_folder(gguf)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", choices=("smollm2", "gemma3"))
    p.add_argument("--forms", default="gguf", help="gguf (the file), float, int8, int4")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--terms-speed", action="store_true", help="time the GGUF's forward instead")
    p.add_argument("--dtype", default="auto", help="the served model's dtype (LLMQ_DTYPE)")
    args = p.parse_args()
    from transformers import AutoTokenizer

    gguf, folder = _files(args.model)
    if args.terms_speed:
        best = terms_speed(gguf)
        for rows in sorted({r for _, r in best}):
            one, two = best[1, rows], best[2, rows]
            print(f"{rows} tokens: 1 term {one:.1f} ms, 2 terms {two:.1f} ms ({two / one:.2f}x)")
        return
    ids = text_ids(AutoTokenizer.from_pretrained(folder), args.tokens)
    ref = reference_log_probs(folder, ids, args.ctx)
    print("| model | form | positions | top-1 disagreement | KL | ppl (float32) | ppl | s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for form in args.forms.split(","):
        path, quant = (gguf, "none") if form == "gguf" else (folder, form)
        quant = "none" if quant == "float" else quant
        got, seconds = served_log_probs(path, ids, args.ctx, quant, args.dtype)
        s = compare(ref, got, ids, args.ctx)
        print(
            f"| {args.model} | {form} | {s['positions']} | {s['top1_disagreement']:.4f} "
            f"| {s['kl']:.5f} | {s['ppl_ref']:.3f} | {s['ppl']:.3f} | {seconds:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
