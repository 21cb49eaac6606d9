"""LoRA adapters in the engine, side by side in one run on a SmolLM2-135M-shaped random model.

* Throughput: 32 concurrent streams (128-token prompts, 64 output tokens, EOS ignored) spread
  over 8 adapters, against the same 32 streams on the base model, in one LLMEngine, alternated
  (base, adapters, adapters, base) so that a drifting machine load favours neither; each round
  has prompts of its own (none found in the prefix cache). Output
  tokens/s of each, over the whole run and over its decode-only steps; the ratio is the figure
  (goal: adapters >= 0.8x the base).
* Decode steps side by side: two engines (the base's streams, the adapters' streams) stepped
  in turn, one step apart; the ratio of their median step times. On a machine that others
  share, this is the steadier of the two ratios.
* Loading: the inter-token latency (one step) of 32 running streams while a ninth adapter is
  read from disk on the pool's thread, against the same streams with no load under way; and
  how long the new request waited for its first token.

The dtype is the worker's ``auto`` (bfloat16 where the CPU has it in hardware, else float32)
unless ``--dtype`` says otherwise; the figures name the one that ran. Peak RSS is reported.

    .venv/bin/python bench/lora.py                # the full run (a few minutes on 2 cores)
    .venv/bin/python bench/lora.py --quick        # a smaller run, for a smoke test
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_paths import (  # noqa: E402  (bench/, beside this file)
    ensure_model,
    log,
    make_prompts,
    median_steps_in_turn,
)

from tests.lora_model import ALL_TARGETS as TARGETS  # noqa: E402
from tests.lora_model import randomize_lora  # noqa: E402

TARGET_RATIO = 0.8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="LoRA adapters in the engine against the base model.")
    p.add_argument("--model-dir", default=str(ROOT / "bench/out/models/smollm2-135m"))
    p.add_argument("--adapter-dir", default=str(ROOT / "bench/out/loras"))
    p.add_argument("--dtype", default="auto", help="auto (the worker's), float32, bfloat16")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="16 output tokens, one round")
    return p.parse_args(argv)


def make_adapters(model_dir: Path, out: Path, count: int, rank: int, targets: list[str]) -> list:
    """``count`` random-weight PEFT adapters of the model (one PEFT model, refilled and saved
    under each name), reused from ``out`` when already there."""
    import torch

    folders = [out / f"r{rank}-{'-'.join(t[:1] for t in targets)}-{i}" for i in range(count)]
    if all((f / "adapter_model.safetensors").exists() for f in folders):
        return folders
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    log(f"building {count} rank-{rank} adapters in {out}")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(0)
    for folder in folders:
        randomize_lora(model, gen, std=0.02)
        model.save_pretrained(folder)
    return folders


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(engine, prompts, loras, output_tokens: int) -> dict:
    """All streams at once; output tokens/s over the run and over its decode-only steps."""
    from llmq.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params, lora=loras[i % len(loras)] if loras else None)
    generated = decode_tokens = 0
    decode_s = 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        prefilling = any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()
        )
        t = time.perf_counter()
        n = sum(len(o.token_ids) for o in engine.step())
        if not prefilling:
            decode_s += time.perf_counter() - t
            decode_tokens += n
        generated += n
    wall = time.perf_counter() - start
    return {"tok_s": generated / wall, "decode_tok_s": decode_tokens / max(decode_s, 1e-9)}


def itl_while_loading(engine, prompts, loras, new_lora, output_tokens: int) -> dict:
    """Step times of running streams: a stretch with no load, then one while ``new_lora``
    is read from disk (a request for it added), until its first token."""
    from llmq.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"i{i}", p, params, lora=loras[i % len(loras)])
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()):
        engine.step()
    quiet, loading = [], []
    for _ in range(output_tokens // 3):
        t = time.perf_counter()
        engine.step()
        quiet.append(time.perf_counter() - t)
    added = time.perf_counter()
    engine.add_request("new", prompts[0][:16], params, lora=new_lora)
    first = None
    while first is None and engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        loading.append(time.perf_counter() - t)
        if any(o.request_id == "new" and o.token_ids for o in outs):
            first = time.perf_counter() - added
    while engine.has_unfinished():
        engine.step()

    def p99(xs):  # nearest rank: the largest of fewer than 100
        return sorted(xs)[math.ceil(len(xs) * 0.99) - 1] * 1000

    return {
        "quiet_itl_p50_ms": statistics.median(quiet) * 1000,
        "quiet_itl_p99_ms": p99(quiet),
        "loading_itl_p50_ms": statistics.median(loading) * 1000,
        "loading_itl_p99_ms": p99(loading),
        "loading_steps": len(loading),
        "new_request_ttft_ms": (first or float("nan")) * 1000,
    }


def interleaved_steps(make_engine, prompts, loras, steps: int) -> dict:
    """Decode steps of 32 streams on the base model and of the same streams over the adapters,
    in two engines stepped in turn. Median step time of each."""
    engines = {"base": make_engine(), "lora": make_engine()}
    requests = {
        "base": [(p, None) for p in prompts],
        "lora": [(p, loras[i % len(loras)]) for i, p in enumerate(prompts)],
    }
    medians = median_steps_in_turn(engines, requests, steps)
    return {f"{kind}_step_ms": ms for kind, ms in medians.items()}


def main(argv=None) -> int:
    import torch

    from llmq.worker.engine.sequence import LoraRef
    from llmq.worker.llm_engine import EngineConfig, LLMEngine
    from llmq.worker.loading.model_loader import load_causal_lm, resolve_dtype

    args = parse_args(argv)
    out_tokens = 16 if args.quick else args.output_tokens
    model_dir = ensure_model(Path(args.model_dir))
    targets = args.targets.split(",")
    folders = make_adapters(
        model_dir, Path(args.adapter_dir), args.adapters + 1, args.rank, targets
    )
    loras = [LoraRef(f.name, str(f)) for f in folders[: args.adapters]]
    spare = LoraRef(folders[-1].name, str(folders[-1]))
    dtype = resolve_dtype(args.dtype, "cpu")
    log(
        f"{args.streams} streams, {args.adapters} adapters of rank {args.rank}, {dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    engine = LLMEngine(
        load_causal_lm(str(model_dir), str(dtype).removeprefix("torch."), "cpu"),
        EngineConfig(max_batch_size=max(64, args.streams), max_loras=args.adapters + 1),
    )
    vocab = engine.vocab_size
    prompts = make_prompts(args.streams, args.prompt_tokens, args.prompt_tokens, vocab, seed=1)
    run(engine, [p[:32] for p in prompts[: args.adapters]], loras, 4)  # warm up, load all 8
    rss_loaded = rss_mib()
    rounds = ["base", "lora"] if args.quick else ["base", "lora", "lora", "base"]
    results: dict[str, list[dict]] = {"base": [], "lora": []}
    for r, kind in enumerate(rounds):
        # Prompts of its own each round: none of its prefill comes from the prefix cache.
        fresh = make_prompts(
            args.streams, args.prompt_tokens, args.prompt_tokens, vocab, seed=10 + r
        )
        results[kind].append(run(engine, fresh, loras if kind == "lora" else None, out_tokens))
        log(f"{kind}: {results[kind][-1]}")
    mean = {k: {m: statistics.mean(r[m] for r in v) for m in v[0]} for k, v in results.items()}
    itl = itl_while_loading(engine, prompts, loras, spare, max(out_tokens, 48))
    del engine

    def make_engine():
        model = load_causal_lm(str(model_dir), str(dtype).removeprefix("torch."), "cpu")
        return LLMEngine(model, EngineConfig(max_batch_size=max(64, args.streams)))

    steps = interleaved_steps(make_engine, prompts, loras, 8 if args.quick else 30)
    ratio = mean["lora"]["tok_s"] / mean["base"]["tok_s"]
    print(
        f"\ndtype {dtype}; model {model_dir.name}; {args.streams} streams "
        f"{args.prompt_tokens}/{out_tokens}; {args.adapters} adapters rank {args.rank} on "
        f"{','.join(targets)}"
    )
    for kind in ("base", "lora"):
        print(
            f"  {kind:5s} output {mean[kind]['tok_s']:7.1f} tok/s   decode-only "
            f"{mean[kind]['decode_tok_s']:7.1f} tok/s"
        )
    print(
        f"  ratio adapters/base: {ratio:.2f}x output (goal >= {TARGET_RATIO}), "
        f"{mean['lora']['decode_tok_s'] / mean['base']['decode_tok_s']:.2f}x decode-only"
    )
    print(
        f"  decode step, two engines stepped in turn: base {steps['base_step_ms']:.0f} ms, "
        f"adapters {steps['lora_step_ms']:.0f} ms: "
        f"{steps['base_step_ms'] / steps['lora_step_ms']:.2f}x the base's tokens/s"
    )
    print("  while a 9th adapter loads: " + ", ".join(f"{k} {v:.1f}" for k, v in itl.items()))
    print(f"  peak RSS {rss_mib():.0f} MiB (after loading the adapters: {rss_loaded:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
