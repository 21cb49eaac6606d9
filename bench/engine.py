"""Side-by-side throughput of the llmq engine against transformers on the same model and cores.

Builds (once) a random-weight model of the SmolLM2-135M shape with ``make_model``, loads it in
bfloat16 (or --dtype float32) and, in one run, generates the same requests (random prompts,
fixed output length, EOS ignored) through:

* llmq's LLMEngine (continuous batching over the paged KV cache), run first and again last so
  that a machine whose load drifts during the run does not favour either side;
* HF ``generate`` one request at a time (timed on a few requests, extrapolated);
* HF ``generate`` on the whole batch, left-padded;
* transformers' own continuous batching (a warmed-up ``init_continuous_batching`` manager);
* the raw decode limit: the model's forward with its own DynamicCache at the engine's batch size
  and mean decode context, timing decode steps only (no prefill, no scheduling), interleaved
  with the engine's runner at the same shape.

It then times one decode step (one token per sequence) of the engine's runner against the HF
DynamicCache forward at batch 32 and 64, context 256, interleaved.

Every figure is taken twice: by wall clock (the headline) and by the process's CPU time (user +
system, all threads). On a machine that other jobs share, wall-clock ratios of phases that ran
minutes apart carry the load's changes; CPU-time ratios mostly do not (the load average during
each phase is recorded too). Absolute figures depend on the machine; compare ratios. Figures go
to stdout and to a JSON file.

    .venv/bin/python bench/engine.py            # the full run (several minutes on 2 cores)
    .venv/bin/python bench/engine.py --quick    # a smaller run, for a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_paths import (  # noqa: E402  (bench/, beside this file)
    EngineDecode,
    HFDecode,
    combine_engine_runs,
    cores,
    ensure_model,
    load,
    log,
    make_prompts,
    run_engine,
    run_hf_cb,
    run_single,
    run_static,
    time_interleaved,
)

TARGETS = {  # engine / path, from the issue
    "hf_continuous_batching": 2.0,
    "hf_static_batch": 1.3,
    "hf_one_at_a_time": 15.0,
}
TARGET_STEADY_VS_RAW = 0.85
TARGET_DECODE_STEP = 2.5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Throughput of the llmq engine against transformers, side by side in one run.",
    )
    p.add_argument(
        "--model-dir",
        default=str(ROOT / "bench/out/models/smollm2-135m"),
        help="model folder; built with make_model (llama, smollm2-135m) if missing",
    )
    p.add_argument("--requests", type=int, default=64, help="number of requests (64)")
    p.add_argument("--min-prompt", type=int, default=64, help="shortest prompt, tokens (64)")
    p.add_argument("--max-prompt", type=int, default=512, help="longest prompt, tokens (512)")
    p.add_argument("--output-tokens", type=int, default=128, help="tokens per request (128)")
    p.add_argument("--max-batch-size", type=int, default=64, help="engine max_batch_size (64)")
    p.add_argument(
        "--max-batch-tokens", type=int, default=512, help="engine max_batch_tokens (512)"
    )
    p.add_argument(
        "--engine-runs",
        type=int,
        choices=(1, 2),
        default=2,
        help="2: the engine runs first and last, figures from both (default); 1: first only",
    )
    p.add_argument(
        "--single",
        type=int,
        default=3,
        help="requests timed for one-at-a-time generate, then extrapolated (3)",
    )
    p.add_argument("--step-batches", default="32,64", help="batches of the decode-step comparison")
    p.add_argument("--step-context", type=int, default=256, help="its context (256)")
    p.add_argument(
        "--step-repeats", type=int, default=10, help="decode steps timed per path, interleaved (10)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: the cores)")
    p.add_argument(
        "--skip",
        default="",
        help="comma-separated paths to leave out: single,static,hf_cb,raw,steps",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="bfloat16 (default; slow where the CPU emulates it: see LLMQ_DTYPE) or float32",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small run: 16 requests, prompts 32..128, 32 output tokens, one engine run, "
        "decode steps at batch 32 only",
    )
    p.add_argument("--out", default=str(ROOT / "bench/out/engine.json"), help="JSON output file")
    args = p.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 16)
        args.min_prompt, args.max_prompt = 32, 128
        args.output_tokens = min(args.output_tokens, 32)
        args.single = min(args.single, 2)
        args.step_repeats = min(args.step_repeats, 4)
        args.step_batches = "32"
        args.engine_runs = 1
        args.max_batch_size = min(args.max_batch_size, args.requests)
    return args


# ---- main ------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    threads = args.threads or cores()
    torch.set_num_threads(threads)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    model_dir = ensure_model(Path(args.model_dir))
    hf = load(model_dir, args.dtype)
    vocab = hf.config.get_text_config().vocab_size
    pad_id = hf.generation_config.pad_token_id or 0
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, vocab, args.seed)
    mean_prompt = sum(map(len, prompts)) / len(prompts)
    full_batch = min(args.max_batch_size, len(prompts))
    log(
        f"model {model_dir.name} {args.dtype}, {threads} torch threads, {len(prompts)} requests, "
        f"prompts {args.min_prompt}..{args.max_prompt} (mean {mean_prompt:.0f}), "
        f"{args.output_tokens} output tokens, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, load average {os.getloadavg()[0]:.1f}"
    )
    report: dict = {
        "config": {
            "model": str(model_dir),
            "dtype": args.dtype,
            "threads": threads,
            "cores": cores(),
            "requests": len(prompts),
            "prompt_tokens": [args.min_prompt, args.max_prompt],
            "mean_prompt": mean_prompt,
            "output_tokens": args.output_tokens,
            "max_batch_size": args.max_batch_size,
            "max_batch_tokens": args.max_batch_tokens,
            "quick": args.quick,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "throughput": {},
    }
    thr = report["throughput"]

    # The engine takes its model over (packed bfloat16 weights replace the modules' own), so
    # every engine path gets a freshly loaded copy.
    def eng_model():
        return load(model_dir, args.dtype)

    engine_runs = []
    log("llmq engine ...")
    engine_runs.append(run_engine(eng_model(), prompts, args))
    log(f"  {engine_runs[-1]['tok_s']:.1f} tok/s")

    if "single" not in skip:
        log(f"HF generate one at a time ({args.single} requests timed, extrapolated) ...")
        thr["hf_one_at_a_time"] = run_single(hf, prompts, args, pad_id)
        log(f"  {thr['hf_one_at_a_time']['tok_s']:.1f} tok/s")
    if "static" not in skip:
        log("HF generate, whole batch left-padded ...")
        thr["hf_static_batch"] = run_static(hf, prompts, args, pad_id)
        log(f"  {thr['hf_static_batch']['tok_s']:.1f} tok/s")
    if "hf_cb" not in skip:
        log("transformers continuous batching ...")
        cb_model = load(model_dir, args.dtype)
        try:
            thr["hf_continuous_batching"] = run_hf_cb(cb_model, prompts, args)
            log(f"  {thr['hf_continuous_batching']['tok_s']:.1f} tok/s")
        except Exception as e:  # report it, keep the other figures
            log(f"  failed: {e!r}")
            thr["hf_continuous_batching"] = {"error": repr(e)}
        del cb_model
        gc.collect()

    if args.engine_runs == 2:
        log("llmq engine, again ...")
        engine_runs.append(run_engine(eng_model(), prompts, args))
        log(f"  {engine_runs[-1]['tok_s']:.1f} tok/s")
    eng = thr["llmq_engine"] = combine_engine_runs(engine_runs, full_batch)

    if "raw" not in skip:
        batch = full_batch
        ctx = round(eng.get("steady_mean_context", mean_prompt + args.output_tokens / 2))
        log(f"raw decode limit (HF forward + DynamicCache, batch {batch}, context {ctx}) ...")
        paths = {"raw": HFDecode(hf, batch, ctx), "engine": EngineDecode(eng_model(), batch, ctx)}
        secs = time_interleaved(paths, args.step_repeats)
        thr["raw_decode_limit"] = {
            "batch": batch,
            "context": ctx,
            "tok_s": batch / secs["raw"]["wall"],
            "tok_per_cpu_s": batch / secs["raw"]["cpu"],
            "engine_runner_same_shape_tok_s": batch / secs["engine"]["wall"],
            "engine_runner_same_shape_tok_per_cpu_s": batch / secs["engine"]["cpu"],
            "note": "decode steps only: no prefill, no scheduling",
        }
        del paths
        gc.collect()
        log(f"  {thr['raw_decode_limit']['tok_s']:.1f} tok/s")

    steps: dict = {}
    if "steps" not in skip:
        for b in [int(x) for x in args.step_batches.split(",") if x]:
            log(f"decode step, batch {b}, context {args.step_context} ...")
            paths = {
                "hf_dynamic_cache": HFDecode(hf, b, args.step_context),
                "llmq_runner": EngineDecode(eng_model(), b, args.step_context),
            }
            secs = time_interleaved(paths, args.step_repeats)
            eng_s, hf_s = secs["llmq_runner"], secs["hf_dynamic_cache"]
            steps[str(b)] = {
                "context": args.step_context,
                "llmq_runner_tok_s": b / eng_s["wall"],
                "hf_dynamic_cache_tok_s": b / hf_s["wall"],
                "ratio": hf_s["wall"] / eng_s["wall"],
                "llmq_runner_tok_per_cpu_s": b / eng_s["cpu"],
                "hf_dynamic_cache_tok_per_cpu_s": b / hf_s["cpu"],
                "ratio_cpu": hf_s["cpu"] / eng_s["cpu"],
            }
            del paths
            gc.collect()
    report["decode_step"] = steps
    report["load_avg_end"] = os.getloadavg()[0]

    report["ratios"] = print_table(report, args, threads, len(prompts), mean_prompt)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


def print_table(report: dict, args, threads: int, n: int, mean_prompt: float) -> dict:
    thr, steps = report["throughput"], report["decode_step"]
    eng = thr["llmq_engine"]
    ratios: dict = {}
    w = 46
    lines = [
        "",
        f"{n} requests, prompts {args.min_prompt}..{args.max_prompt} random tokens (mean "
        f"{mean_prompt:.0f}), {args.output_tokens} output tokens each (EOS ignored), {args.dtype}, "
        f"{threads} threads",
        f"{'path':<{w}}{'tok/s':>9}{'engine/path':>13}{'tok/cpu-s':>11}{'engine/path':>13}"
        f"{'target':>9}{'load':>11}",
        f"{'':<{w}}{'(wall clock)':>22}{'(CPU time)':>24}",
    ]
    names = {
        "llmq_engine": f"llmq engine (max_batch_size {args.max_batch_size})",
        "hf_one_at_a_time": "HF generate, one at a time (extrapolated*)",
        "hf_static_batch": "HF generate, whole batch, left-padded",
        "hf_continuous_batching": "transformers continuous batching",
        "raw_decode_limit": "raw decode limit (HF forward + DynamicCache)",
    }

    def load_of(r):
        la = r.get("load_avg")
        return f"{min(la):.1f}-{max(la):.1f}" if la else ""

    for key, label in names.items():
        r = thr.get(key)
        if not r:
            continue
        if "tok_s" not in r:
            lines.append(f"{label:<{w}}{'failed':>9}")
            continue
        rw, rc = eng["tok_s"] / r["tok_s"], eng["tok_per_cpu_s"] / r["tok_per_cpu_s"]
        ratios[key] = {"wall": rw, "cpu": rc}
        target = TARGETS.get(key)
        tgt = f">= {target:g}x" if target else ""
        loads = ", ".join(load_of(x) for x in eng["runs"]) if key == "llmq_engine" else load_of(r)
        lines.append(
            f"{label:<{w}}{r['tok_s']:>9.1f}{rw:>12.2f}x{r['tok_per_cpu_s']:>11.1f}{rc:>12.2f}x"
            f"{tgt:>9}{loads:>11}"
        )
    raw = thr.get("raw_decode_limit")
    if "steady_tok_s" in eng:
        label = f"llmq steady-state decode (batch {eng['steady_batch']})"
        line = f"{label:<{w}}{eng['steady_tok_s']:>9.1f}"
        if raw:
            rw = eng["steady_tok_s"] / raw["tok_s"]
            rc = eng["steady_tok_per_cpu_s"] / raw["tok_per_cpu_s"]
            ratios["steady_vs_raw"] = {"wall": rw, "cpu": rc}
            line += (
                f"{rw:>12.2f}x{eng['steady_tok_per_cpu_s']:>11.1f}{rc:>12.2f}x"
                f"{'>= ' + str(TARGET_STEADY_VS_RAW) + 'x':>9}  of the raw limit"
            )
        lines.append(line)
    if "hf_one_at_a_time" in thr:
        s = thr["hf_one_at_a_time"]
        lines.append(
            f"* one at a time: {s['timed_requests']} requests timed (prompt lengths "
            f"{s['timed_prompt_lengths']}), {s['seconds']:.1f} s, extrapolated to {n} requests "
            f"({s['seconds_extrapolated']:.0f} s)"
        )
    if raw:
        lines.append(
            f"raw decode limit: batch {raw['batch']}, context {raw['context']} (the engine's "
            f"steady-state batch and mean context); the engine's runner at that shape, "
            f"interleaved with it: {raw['engine_runner_same_shape_tok_s']:.1f} tok/s, "
            f"{raw['engine_runner_same_shape_tok_per_cpu_s']:.1f} tok/cpu-s"
        )
    runs = eng["runs"]
    run_secs = ", ".join(f"{r['seconds']:.1f}" for r in runs)
    run_rates = ", ".join(f"{r['tok_s']:.1f}" for r in runs)
    lines.append(
        f"engine: {len(runs)} run(s) of {run_secs} s (tok/s {run_rates}), {eng['steps']} steps, "
        f"{eng['preemptions']} preemptions; load average = runnable tasks on "
        f"{report['config']['cores']} cores"
    )
    if steps:
        lines += [
            "",
            f"decode step (one token per sequence), context {args.step_context}, interleaved, "
            "median of each",
            f"{'batch':<8}{'llmq runner':>13}{'HF DynamicCache':>17}{'ratio':>9}"
            f"{'ratio by CPU time':>19}{'target':>9}",
        ]
        for b, r in steps.items():
            lines.append(
                f"{b:<8}{r['llmq_runner_tok_s']:>9.1f} t/s{r['hf_dynamic_cache_tok_s']:>13.1f} t/s"
                f"{r['ratio']:>8.2f}x{r['ratio_cpu']:>18.2f}x"
                f"{'>= ' + str(TARGET_DECODE_STEP) + 'x':>9}"
            )
            ratios[f"decode_step_{b}"] = {"wall": r["ratio"], "cpu": r["ratio_cpu"]}
    print("\n".join(lines), flush=True)
    return ratios


if __name__ == "__main__":
    sys.exit(main())
