"""Speculative decoding (prompt lookup) on SmolLM2-135M-Instruct in bfloat16: output tokens/s
with and without it, per workload, one stream alone and 16 at once, with the acceptance rate,
the mean tokens a verifying step yields and each run's peak RSS, in one run.

Each configuration runs in a fresh process (its own peak RSS) that builds the engine a worker
builds (``build_backend``) from ``LLMQ_*`` settings and runs the workloads, greedy, through the
engine in-process (no Redis, no HTTP: the engine's speed alone). A workload's prompt is 250-450
tokens written for what users do: rewrite a function that is in the prompt, quote a document's
sentences that answer a question, extract a text's fields as JSON, continue a chat that quotes
itself, free writing. The lone stream runs each prompt alone (output tokens/s after its first
token); 16 streams run 16 requests of the workload at once (four variants of its question, four
times each; output tokens/s of all, from the first arrival to the last token).

    .venv/bin/python bench/speculative.py                 # off against ngram, all workloads
    .venv/bin/python bench/speculative.py --tokens 128 --configs "off" "ngram;k=6"
    .venv/bin/python bench/speculative.py --configs off ngram suffix "draft;draft=gguf" \
        "draft;draft=self;draft_q=int4"     # suffix decoding; the Q4_1 GGUF or int4 drafting
    .venv/bin/python bench/speculative.py --crossover "code edit"   # batch sizes, one process

``--llama-cpp [BIN_DIR]`` adds llama.cpp's server on the same prompts and weights (the bf16
GGUF of the same float folder), one server per ``--spec-type`` setting
(``bench/speculative_llama_cpp.py``), and a table of llmq against llama.cpp's best speculation
per workload:

    .venv/bin/python bench/speculative.py --llama-cpp   # the peer script's build

``--crossover`` runs one workload's prompts at 1, 2, 4, 8 and 16 streams on an engine without
speculation and on one that never steps aside, turn about in one process (so that both see
the same load on the host): where speculation stops paying is ``LLMQ_SPECULATIVE_MAX_BATCH``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import speculative_llama_cpp as llama_cpp  # noqa: E402  (beside this file)


def workloads(tok) -> dict[str, list[list[int]]]:
    """Per workload's title, its four prompts (chat-templated token ids)."""
    from llmq.tools.bench_workloads import workload_chats

    def ids(messages):
        return list(
            tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )

    return {title: [ids(c) for c in chats] for title, chats in workload_chats().values()}


def child(config: str, tokens: int, folder: str, kinds: list[str], streams: int) -> dict:
    """One configuration's figures (in a process of its own)."""
    import torch
    from transformers import AutoTokenizer

    from llmq.common.sampling_params import SamplingParams
    from llmq.common.settings import Settings
    from llmq.worker.service import build_backend

    fields = dict(kv.split("=", 1) for kv in config.split(";")[1:] if kv)
    method = config.split(";")[0]
    # A config's keys override the worker's defaults (`LLMQ_SPECULATIVE_*`), which it keeps.
    names = {"k": "tokens", "max_batch": "max_batch", "min_n": "ngram_min", "max_n": "ngram_max"}
    given = {f"speculative_{names[k]}": int(v) for k, v in fields.items() if k in names}
    settings = Settings(
        model=folder,
        device="cpu",
        dtype="bfloat16",
        speculative_method=method,
        speculative_model=draft_model(fields.get("draft", ""), folder),
        speculative_quantization=fields.get("draft_q", "none"),
        **given,
    )
    engine = build_backend(settings)[0].engine
    loads = workloads(AutoTokenizer.from_pretrained(folder))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=False)
    engine.generate([loads["free writing"][0]], SamplingParams(temperature=0, max_tokens=8))
    result = {}
    for name in kinds:
        prompts = loads[name]
        before = spec_counts(engine)
        runs = [lone(engine, p, params) for p in prompts]
        after = spec_counts(engine)
        batch = _streams(engine, (prompts * streams)[:streams], params) if streams else None
        result[name] = {
            "prompt_tokens": sum(map(len, prompts)) / len(prompts),
            "lone_tps": sum(n for n, _ in runs) / sum(t for _, t in runs),
            "lone_tokens": sum(n for n, _ in runs),
            "streams_tps": batch,
            "acceptance": _rate(before, after),
        }
    torch.set_num_threads(torch.get_num_threads())
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def draft_model(name: str, folder: str) -> str:
    """``draft=`` of a config: ``gguf``, the Q4_1 GGUF of the float folder; ``self``, the
    float folder (quantized by ``draft_q=``); else a path."""
    from tests import real_models

    return {"gguf": lambda: str(real_models.smollm2_gguf()), "self": lambda: folder}.get(
        name, lambda: name
    )()


def crossover(kind: str, tokens: int, folder: str) -> None:
    """Output tokens/s at 1-16 streams, without and with speculation (never stepping aside)."""
    from transformers import AutoTokenizer

    from llmq.common.sampling_params import SamplingParams
    from llmq.common.settings import Settings
    from llmq.worker.service import build_backend

    engines = {}
    for method in ("off", "ngram"):
        s = Settings(model=folder, device="cpu", dtype="bfloat16", speculative_method=method)
        s.speculative_max_batch = 1024
        engines[method] = build_backend(s)[0].engine
    prompts = workloads(AutoTokenizer.from_pretrained(folder))[kind]
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    for engine in engines.values():  # warm: the first steps build what later ones reuse
        engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
    for n in (1, 2, 4, 8, 16):
        batch = (prompts * 4)[:n]
        rates = {m: _streams(e, batch, params) for m, e in engines.items()}
        print(
            f"{kind}, {n} streams: off {rates['off']:.1f} tok/s, ngram {rates['ngram']:.1f} "
            f"tok/s ({rates['ngram'] / rates['off']:.2f}x)",
            flush=True,
        )


def spec_counts(engine) -> tuple[int, int, int]:
    s = engine.speculator.stats if engine.speculator is not None else None
    return (s.verified, s.proposed, s.accepted) if s is not None else (0, 0, 0)


def _rate(before, after) -> tuple[float, float]:
    verified, proposed, accepted = (a - b for a, b in zip(after, before, strict=True))
    if not verified:
        return (0.0, 1.0)
    return (accepted / max(proposed, 1), (accepted + verified) / verified)


def lone(engine, prompt, params) -> tuple[int, float]:
    """Output tokens after the first and the seconds they took."""
    engine.add_request(f"lone-{engine.num_requests_total}", prompt, params)
    n, first = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            n += len(out.token_ids)
        if first is None and n:
            first, n = time.perf_counter(), 0
    return n, time.perf_counter() - first


def _streams(engine, prompts, params) -> float:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(map(len, outs)) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["off", "ngram"])
    ap.add_argument("--tokens", type=int, default=128, help="most output tokens per request")
    ap.add_argument("--workloads", nargs="+", default=None)
    ap.add_argument("--crossover", metavar="WORKLOAD", help="tok/s at 1-16 streams, off and on")
    ap.add_argument(
        "--llama-cpp",
        nargs="?",
        type=Path,
        const=llama_cpp.DEFAULT_BIN,
        metavar="BIN_DIR",
        help="also llama.cpp's llama-server of BIN_DIR (default: the peer script's build)",
    )
    ap.add_argument(
        "--llama-cpp-settings",
        nargs="+",
        default=llama_cpp.SETTINGS,
        help="llama.cpp's speculation settings: none, or a --spec-type with ;key=value drafts",
    )
    ap.add_argument(
        "--llama-cpp-threads",
        type=int,
        default=os.cpu_count(),
        help="llama-server's -t (its threads spin at each barrier: on a host busy with other "
        "work one thread can outrun two)",
    )
    ap.add_argument(
        "--streams", type=int, default=16, help="streams run at once (0: the lone stream alone)"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from tests import real_models

    folder = str(real_models.float_folder(real_models.smollm2_gguf()))
    if args.crossover:
        crossover(args.crossover, args.tokens, folder)
        return
    kinds = args.workloads or [
        "code edit",
        "document QA (quotes)",
        "JSON extraction",
        "multi-turn chat",
        "free writing",
    ]
    if args.child:
        print(json.dumps(child(args.child, args.tokens, folder, kinds, args.streams)))
        return
    results = {}
    for config in args.configs:
        cmd = [sys.executable, __file__, "--child", config, "--tokens", str(args.tokens)]
        cmd += ["--streams", str(args.streams)]
        cmd += ["--workloads", *kinds]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ)
        results[config] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{config}: peak RSS {results[config]['peak_rss_mib']:.0f} MiB", flush=True)
    report(results, args.configs, kinds)
    if args.llama_cpp:
        from transformers import AutoTokenizer

        loads = workloads(AutoTokenizer.from_pretrained(folder))
        settings, threads = args.llama_cpp_settings, args.llama_cpp_threads
        peer = llama_cpp.run_all(
            args.llama_cpp, folder, settings, threads, loads, kinds, args.tokens, args.streams
        )
        report(peer, list(peer), kinds)
        side_by_side(results | peer, args.configs, list(peer), kinds, args.streams)


def report(results: dict, configs: list[str], kinds: list[str]) -> None:
    base = configs[0]
    head = "| work | prompt | " + " | ".join(f"{c} 1 stream | {c} streams" for c in configs)
    print(head + " |")
    print("|" + " --- |" * (2 + 2 * len(configs)))
    for kind in kinds:
        cells = [kind, f"{results[base][kind]['prompt_tokens']:.0f}"]
        b = results[base][kind]
        for c in configs:
            r = results[c][kind]
            rate, mean = r["acceptance"]
            lone = f"{r['lone_tps']:.1f}"
            streams = f"{r['streams_tps']:.1f}" if r["streams_tps"] else "-"
            if c != base:
                step = f", {mean:.2f}/step" if mean is not None else ""
                lone += f" ({r['lone_tps'] / b['lone_tps']:.2f}x; {rate:.0%}{step})"
                if b["streams_tps"]:
                    streams += f" ({r['streams_tps'] / b['streams_tps']:.2f}x)"
            cells += [lone, streams]
        print("| " + " | ".join(cells) + " |")


def side_by_side(
    results: dict, llmq: list[str], peer: list[str], kinds: list[str], streams: int
) -> None:
    """llmq without and with speculation against llama.cpp without and with its best
    speculation setting, per workload and load (1 stream, 16 streams)."""
    print(
        "| work | streams | llmq off | llmq speculative | llama.cpp none | "
        "llama.cpp best speculation | llmq speculative / llama.cpp best |"
    )
    print("|" + " --- |" * 7)
    for kind in kinds:
        for key, load in (("lone_tps", "1"), ("streams_tps", str(streams))):
            if not results[llmq[0]][kind][key]:
                continue
            rows = {c: results[c][kind] for c in llmq + peer}
            on = max(llmq[1:], key=lambda c: rows[c][key])
            theirs = max(peer[1:], key=lambda c: rows[c][key])
            ours, their = rows[on], rows[theirs]
            cells = [
                kind,
                load,
                f"{rows[llmq[0]][key]:.1f}",
                f"{ours[key]:.1f} ({on}, {ours['acceptance'][0]:.0%})",
                f"{rows[peer[0]][key]:.1f}",
                f"{their[key]:.1f} ({theirs.removeprefix('llama.cpp ')}, "
                f"{their['acceptance'][0]:.0%})",
                f"{ours[key] / their[key]:.2f}x",
            ]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
