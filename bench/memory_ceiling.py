"""A lone stream's decode against the memory's ceiling: the bytes a decode step reads a token,
the machine's read bandwidth measured in this run, and what each server's one-stream inter-token
time (from a ``bench/compare.py`` JSON) makes of them.

A decode step at one stream reads every layer's weights once (projections, their scales, the
norms) and the head; the embedding table gives one row. So ``bytes / ITL`` is the pace the step
reads at, and ``bytes / bandwidth`` the shortest token time the memory allows.

* llmq's bytes: the quantized forward built in this process as a worker builds it
  (``load_causal_lm`` with ``--quantization``), its layers' tensors as the fused step takes them
  and its head's;
* llama.cpp's: the GGUF's tensors (``gguf``'s reader), all but ``token_embd`` unless it is the
  head too (no ``output.weight``);
* the bandwidth: torch summing a 1 GiB float32 buffer on every core, the best of five.

    QUANT=Q4_K_M .venv/bin/python bench/compare.py --servers llmq,llamacpp --loads c \\
        --model-dir bench/out/models/llama-1b --llmq-env LLMQ_QUANTIZATION=int4
    .venv/bin/python bench/memory_ceiling.py --model-dir bench/out/models/llama-1b \\
        --quantization int4 --gguf Q4_K_M --compare-json bench/out/compare.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def read_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """The machine's read pace (GB/s): a buffer far past the caches summed on every core."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def _tensor_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.nbytes)
    return sum(seen.values())


def llmq_bytes(model_dir: str, quantization: str | None) -> int:
    """Bytes llmq's decode step reads a token: its layers' tensors and its head's."""
    from llmq.worker.llm_engine import EngineConfig, LLMEngine
    from llmq.worker.loading.model_loader import load_causal_lm
    from llmq.worker.runner.forward import decoder_cpp_step

    engine = LLMEngine(load_causal_lm(model_dir, "bfloat16", "cpu", quantization), EngineConfig())
    forward = engine.runner.forward
    head = forward.lm_head
    head_tensors = [getattr(head, name, None) for name in ("weight", "bias")]
    head_tensors.append(decoder_cpp_step._scales(head))
    return _tensor_bytes(decoder_cpp_step.layer_tensors(forward.layers) + head_tensors)


def gguf_bytes(path: Path) -> int:
    """Bytes llama.cpp's decode reads a token from a GGUF: every tensor but the embedding
    table, which is read whole only when it is the head too."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def itl_p50(compare_json: Path, server: str) -> float | None:
    results = json.loads(compare_json.read_text())["results"].get(server, {})
    runs = results.get("loads", {}).get("c") or []
    return runs[0]["summary"]["itl_s"]["p50"] if runs else None


def report(forms: list[tuple[str, int, float | None]], bandwidth: float) -> str:
    lines = [
        f"read bandwidth {bandwidth:.1f} GB/s (all cores, best of 5)",
        f"{'form':28} {'GB a token':>10} {'ceiling tok/s':>13} {'ITL p50 ms':>10} "
        f"{'read GB/s':>9} {'of ceiling':>10}",
    ]
    for name, nbytes, itl in forms:
        gb = nbytes / 1e9
        row = f"{name:28} {gb:10.3f} {bandwidth / gb:13.1f}"
        if itl:
            row += f" {itl * 1e3:10.1f} {gb / itl:9.1f} {gb / itl / bandwidth:10.0%}"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(ROOT / "bench/out/models/llama-1b"))
    p.add_argument("--quantization", default="int4", help="llmq's form: int8, int4 or none")
    p.add_argument("--gguf", default="", help="llama.cpp's form (its GGUF beside the model)")
    p.add_argument("--compare-json", default="", help="bench/compare.py's output, load c")
    args = p.parse_args(argv)
    quantization = None if args.quantization == "none" else args.quantization
    compare = Path(args.compare_json) if args.compare_json else None
    forms = [
        (
            f"llmq {args.quantization}",
            llmq_bytes(args.model_dir, quantization),
            itl_p50(compare, "llmq") if compare else None,
        )
    ]
    if args.gguf:
        path = Path(args.model_dir) / f".llama-cpp-{args.gguf}.gguf"
        itl = itl_p50(compare, "llamacpp") if compare else None
        forms.append((f"llama.cpp {args.gguf}", gguf_bytes(path), itl))
    print(report(forms, read_gbs()))
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
