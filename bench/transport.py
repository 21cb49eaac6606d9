"""What the trip through Redis and a separate worker process costs: the engine benchmark's load
through the TokenGeneratorPipeline + a real redis-server + a real `llmq worker` process, against
the same engine in this process (LLMEngine, no Redis), side by side in one run.

* throughput: the 64 requests of bench/engine.py (prompts of 64..512 random token ids, 128
  output tokens each, EOS ignored, greedy), all submitted at once; output tokens per second of
  each path and their ratio (target: worker / in-process >= 0.9). The two paths take turns
  (in-process, worker, in-process, worker, ... for --rounds rounds), never at the same time.
* time to first token of one short request alone (median of --ttft-repeats, the paths
  alternating): in-process, from add_request to the step that samples its first token; through
  the worker, from ``pipeline.submit`` to the first chunk out of the stream. The difference is
  the TTFT that Redis and the worker loop add (target <= 5 ms).

Both paths use the same settings (the worker's defaults: max_batch_size, max_batch_tokens, KV
budget, prefix caching), bfloat16, and the same number of torch threads (default: the cores;
LLMQ_TORCH_THREADS for the worker, torch.set_num_threads here).

    .venv/bin/python bench/transport.py            # SmolLM2-135M-shaped model (a few minutes)
    .venv/bin/python bench/transport.py --tiny     # a tiny model and a smaller load (quick)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_paths import cores, log, make_prompts  # noqa: E402  (bench/, the engine bench's)
from transport_paths import CpuMeter, InProcess, ThroughWorker  # noqa: E402

TARGET_THROUGHPUT_RATIO = 0.9
TARGET_ADDED_TTFT_MS = 5.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Throughput and TTFT through the pipeline + Redis + a worker process, "
        "against the in-process engine, in one run."
    )
    p.add_argument(
        "--model-dir",
        default=str(ROOT / "bench/out/models/smollm2-135m"),
        help="model folder; built with make_model (llama, smollm2-135m) if missing",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny llama (bench/out/models/tiny-llama) and 32 requests of 32..128 "
        "tokens, 32 output tokens: a quick run",
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="throughput rounds; each runs the in-process engine, then the worker (2)",
    )
    p.add_argument(
        "--ttft-repeats",
        type=int,
        default=9,
        help="single requests timed per path for the TTFT (9)",
    )
    p.add_argument("--ttft-prompt", type=int, default=32, help="prompt tokens of those (32)")
    p.add_argument(
        "--only",
        choices=["ttft", "throughput"],
        help="measure only the TTFT or only the throughput (default both)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: the cores)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench/out/transport.json"))
    args = p.parse_args(argv)
    if args.tiny:
        if args.model_dir == p.get_default("model_dir"):
            args.model_dir = str(ROOT / "bench/out/models/tiny-llama")
        args.requests = min(args.requests, 32)
        args.min_prompt, args.max_prompt = 32, 128
        args.output_tokens = min(args.output_tokens, 32)
    return args


def ensure_model(path: Path, tiny: bool) -> Path:
    if (path / "config.json").exists():
        return path
    from llmq.tools.model_factory import make_model

    size = "tiny" if tiny else "smollm2-135m"
    log(f"building a {size} llama in {path}")
    return make_model(path, arch="llama", size=size)


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from llmq.common.model_files import load_tokenizer
    from llmq.common.sampling_params import SamplingParams
    from llmq.common.settings import Settings
    from llmq.common.transport.redis_server import RedisServer
    from tests.harness import start_worker

    threads = args.threads or cores()
    torch.set_num_threads(threads)
    model_dir = ensure_model(Path(args.model_dir), args.tiny).resolve()
    settings = Settings(_env_file=None, model=str(model_dir), dtype=args.dtype, device="cpu")
    tok = load_tokenizer(str(model_dir))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model_dir)).get_text_config().vocab_size
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, vocab, args.seed)
    mean_prompt = sum(map(len, prompts)) / len(prompts)
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    warm_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ttft_params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    # distinct prompts everywhere: no prefix-cache hit helps either path
    warm = make_prompts(8, 48, 48, vocab, args.seed + 1)
    ttft_prompts = make_prompts(
        2 * (args.ttft_repeats + 2), args.ttft_prompt, args.ttft_prompt, vocab, args.seed + 2
    )
    log(
        f"model {model_dir.name} {args.dtype}, {threads} torch threads, {len(prompts)} requests, "
        f"prompts {args.min_prompt}..{args.max_prompt} (mean {mean_prompt:.0f}), "
        f"{args.output_tokens} output tokens; TTFT: {args.ttft_repeats} single requests of "
        f"{args.ttft_prompt} tokens"
    )

    log("in-process engine: loading")
    inproc = InProcess(model_dir, args.dtype, settings)
    inproc._thread.submit(inproc.run, warm, warm_params).result()

    tmp = Path(tempfile.mkdtemp(prefix="llmq-transport-bench-"))
    report: dict = {
        "config": {
            "model": str(model_dir),
            "dtype": args.dtype,
            "threads": threads,
            "requests": len(prompts),
            "prompt_tokens": [args.min_prompt, args.max_prompt],
            "mean_prompt": mean_prompt,
            "output_tokens": args.output_tokens,
            "rounds": args.rounds,
            "ttft_repeats": args.ttft_repeats,
            "ttft_prompt": args.ttft_prompt,
            "max_batch_size": settings.max_batch_size,
            "max_batch_tokens": settings.max_batch_tokens,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        }
    }
    with RedisServer() as redis_server:
        log(f"worker: starting (redis {redis_server.url}, log {tmp}/worker-bench.log)")
        worker = start_worker(
            redis_server.url,
            model_dir,
            "bench",
            tmp,
            dtype=args.dtype,
            torch_threads=threads,
        )
        try:
            report.update(
                asyncio.run(
                    _measure(
                        worker.proc.pid,
                        args,
                        inproc,
                        redis_server.url,
                        tok,
                        model_dir,
                        prompts,
                        params,
                        warm,
                        warm_params,
                        ttft_prompts,
                        ttft_params,
                    )
                )
            )
        finally:
            code = worker.terminate()
            log(f"worker stopped ({code})")

    thr, tt = report["throughput"], report["ttft"]
    summary: dict = {}
    lines = [""]
    if thr["in_process"]:
        in_tps = [r["tok_s"] for r in thr["in_process"]]
        wk_tps = [r["tok_s"] for r in thr["worker"]]
        ratios = [w / i for i, w in zip(in_tps, wk_tps, strict=True)]
        ratio = statistics.median(wk_tps) / statistics.median(in_tps)
        # output tokens per CPU-second of the serving side: the in-process engine's own
        # process, the worker process (the client's share is left out of both)
        per_cpu_in = statistics.median(
            r["tok_s"] / r["this_process_cores"] for r in thr["in_process"]
        )
        per_cpu_wk = statistics.median(r["tok_s"] / r["worker_cores"] for r in thr["worker"])
        summary.update(
            in_process_tok_s=statistics.median(in_tps),
            worker_tok_s=statistics.median(wk_tps),
            ratio=ratio,
            ratio_per_round=ratios,
            in_process_tok_per_cpu_s=per_cpu_in,
            worker_tok_per_cpu_s=per_cpu_wk,
            ratio_per_cpu_s=per_cpu_wk / per_cpu_in,
        )
        lines += [
            f"{len(prompts)} requests, prompts {args.min_prompt}..{args.max_prompt} random "
            f"tokens (mean {mean_prompt:.0f}), {args.output_tokens} output tokens each (EOS "
            f"ignored), {args.dtype}, {threads} torch threads, {args.rounds} rounds (paths "
            "alternating)",
            f"{'path':<46}{'output tok/s':>14}{'per round':>24}{'tok per CPU-s':>15}",
            f"{'in-process LLMEngine':<46}{summary['in_process_tok_s']:>14.1f}"
            f"{'  ' + ', '.join(f'{x:.1f}' for x in in_tps):>24}{per_cpu_in:>15.1f}",
            f"{'pipeline + Redis + llmq worker process':<46}{summary['worker_tok_s']:>14.1f}"
            f"{'  ' + ', '.join(f'{x:.1f}' for x in wk_tps):>24}{per_cpu_wk:>15.1f}",
            f"{'ratio worker / in-process':<46}{ratio:>13.2f}x"
            f"{'  ' + ', '.join(f'{x:.2f}' for x in ratios):>24}{per_cpu_wk / per_cpu_in:>14.2f}x"
            f"   target >= {TARGET_THROUGHPUT_RATIO}",
            "cores used per wall second during each path (median of the rounds): "
            + "; ".join(
                f"{name}: worker {med(thr[key], 'worker_cores'):.2f}, this process "
                f"{med(thr[key], 'this_process_cores'):.2f}, whole machine "
                f"{med(thr[key], 'machine_busy_cores'):.2f}"
                for key, name in (("in_process", "in-process"), ("worker", "worker"))
            ),
            "tok per CPU-s: output tokens per CPU-second of the serving process (this process "
            "for in-process, the worker process for the other path)",
            "",
        ]
    if tt["in_process"]:
        in_ms = statistics.median(tt["in_process"]) * 1000
        wk_ms = statistics.median(r["ttft"] for r in tt["worker"]) * 1000
        part = {k: statistics.median(r[k] for r in tt["worker"]) * 1000 for k in tt["worker"][0]}
        added_ms = wk_ms - in_ms
        summary.update(
            ttft_in_process_ms=in_ms,
            ttft_worker_ms=wk_ms,
            added_ttft_ms=added_ms,
            ttft_worker_parts_ms=part,
        )
        lines += [
            f"time to first token, one request of {args.ttft_prompt} tokens alone, median of "
            f"{args.ttft_repeats} (paths alternating)",
            f"{'in-process LLMEngine':<46}{in_ms:>11.1f} ms",
            f"{'pipeline + Redis + llmq worker process':<46}{wk_ms:>11.1f} ms",
            f"{'  submit (subscribe + enqueue, client side)':<46}{part['submit']:>11.1f} ms",
            f"{'  enqueued -> worker marks it running':<46}{part['pickup']:>11.1f} ms",
            f"{'  running -> first token at the client':<46}{part['first']:>11.1f} ms",
            f"{'added by the trip through Redis and the worker':<46}{added_ms:>11.1f} ms"
            f"   target <= {TARGET_ADDED_TTFT_MS:g} ms",
        ]
    report["summary"] = summary
    print("\n".join(lines), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


async def _measure(
    worker_pid,
    args,
    inproc,
    redis_url,
    tok,
    model_dir,
    prompts,
    params,
    warm,
    warm_params,
    ttft_prompts,
    ttft_params,
) -> dict:
    through = ThroughWorker(model_dir, redis_url, tok, str(model_dir))
    try:
        await through.run(warm, warm_params)
        # TTFT: one request alone, the paths alternating; one untimed each first
        await inproc.call(inproc.ttft, ttft_prompts[0], ttft_params)
        await through.ttft(ttft_prompts[1], ttft_params)
        ttft = {"in_process": [], "worker": []}
        for i in range(0 if args.only == "throughput" else args.ttft_repeats):
            ttft["in_process"].append(
                await inproc.call(inproc.ttft, ttft_prompts[2 + 2 * i], ttft_params)
            )
            ttft["worker"].append(await through.ttft(ttft_prompts[3 + 2 * i], ttft_params))
        if ttft["worker"]:
            log(
                f"TTFT in-process {statistics.median(ttft['in_process']) * 1000:.1f} ms, "
                f"worker {statistics.median(r['ttft'] for r in ttft['worker']) * 1000:.1f} ms"
            )
        thr = {"in_process": [], "worker": []}
        for r in range(0 if args.only == "ttft" else args.rounds):
            # round 1: the engine benchmark's prompts; later rounds: fresh prompts of the same
            # shape (the same for both paths), so no round is helped by the prefix cache
            if r:
                prompts = make_prompts(
                    len(prompts),
                    args.min_prompt,
                    args.max_prompt,
                    inproc.vocab,
                    args.seed + 100 * r,
                )
            cpu = CpuMeter(worker_pid)
            secs, n = await inproc.call(inproc.run, prompts, params)
            thr["in_process"].append(
                {"seconds": secs, "output_tokens": n, "tok_s": n / secs, **cpu.read(secs)}
            )
            log(f"round {r + 1}: in-process {n / secs:.1f} tok/s ({secs:.1f} s) {cpu.text}")
            cpu = CpuMeter(worker_pid)
            secs, n = await through.run(prompts, params)
            thr["worker"].append(
                {"seconds": secs, "output_tokens": n, "tok_s": n / secs, **cpu.read(secs)}
            )
            log(f"round {r + 1}: worker     {n / secs:.1f} tok/s ({secs:.1f} s) {cpu.text}")
        return {"throughput": thr, "ttft": ttft}
    finally:
        await through.close()
        inproc.close()


if __name__ == "__main__":
    sys.exit(main())
