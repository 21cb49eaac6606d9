"""llmq against its peers (vLLM's CPU build, llama.cpp's server, `transformers serve`), one
model folder, the same loads.

Serves the model folder (default bench/out/models/smollm2-135m, bfloat16) with each server in
turn on the same cores:

* llmq: ``llmq up`` with LLMQ_MODEL=folder, LLMQ_DTYPE=bfloat16 and its embedded Redis;
* vllm: ../shared/peers/vllm-cpu.sh (vLLM's CPU build in its own venv);
* llamacpp: ../shared/peers/llama-cpp.sh (llama-server on a bf16 GGUF of the folder, one slot
  per stream of the busiest load; its first run builds llama-server, about 10 minutes on 2 cores).
  It runs one thread per core unless THREADS is set: its threads meet at a barrier every op, so
  a neighbour on one core stalls them all: in consecutive runs on 2 busy shared cores, THREADS=1
  gave it 6.1x the output of 2 threads on one stream and 4.8x at 32 streams (34.9 against 5.7,
  82.6 against 17.1 tok/s);
* transformers: ../shared/peers/transformers-serve.sh (``transformers serve --continuous-batching``);

warms each up, drives it with the same ``llmq bench`` loads (the bench module's own argument
parser and code, in this process), each load in rounds of the same prompts (round 1: prompts the
server has not seen; round 2 on: the same again, which prefix caches serve), samples the server's
resident memory (VmRSS summed over its process tree, every 0.5 s), stops it cleanly and starts
the next. Loads:

* a: 32 streams of 128 prompt / 64 output tokens
* b: 64 streams of 128 / 128
* c: one stream of 128 / 64
* d: 16 streams of 128 / 64 (the quantized comparison's busy load)

It prints one table (output tok/s, TTFT p50/p99, ITL p50/p99, peak RSS per load and round) with
llmq's ratio to each peer, and writes bench/out/compare.json and bench/out/compare.png (first
rounds; with matplotlib: ``pip install -e '.[bench]'``).

    .venv/bin/python bench/compare.py                          # llmq, vllm, llamacpp; all loads
    .venv/bin/python bench/compare.py --servers llmq --scale 0.5
    .venv/bin/python bench/compare.py --loads a,c --servers llmq,llamacpp --rounds 2
    .venv/bin/python bench/compare.py --servers llmq,vllm,llamacpp,transformers
    .venv/bin/python bench/compare.py --chart-from bench/out/compare.json --png docs/compare.png

The machine is shared: the table also shows how many cores the server used and how busy the
whole machine was during each load, so that a figure taken while something else ran can be seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compare_procs import cores  # noqa: E402  (bench/, beside this file)
from compare_report import chart, ms, table  # noqa: E402
from compare_server import Server, log  # noqa: E402

from llmq.tools import bench_cli  # noqa: E402

LOADS = {
    "a": {"concurrency": 32, "prompt": 128, "output": 64, "requests": 64},
    "b": {"concurrency": 64, "prompt": 128, "output": 128, "requests": 128},
    "c": {"concurrency": 1, "prompt": 128, "output": 64, "requests": 8},
    "d": {"concurrency": 16, "prompt": 128, "output": 64, "requests": 32},
}
SERVERS = ("llmq", "vllm", "llamacpp", "transformers")
DEFAULT_SERVERS = "llmq,vllm,llamacpp"


def llmq_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("LLMQ_"):
            raise SystemExit(f"--llmq-env takes LLMQ_NAME=VALUE, not {pair!r}")
        env[name] = value
    return env


# ---- the loads -------------------------------------------------------------------------------
def bench_argv(base: str, model: Path, load: dict, label: str, seed: int) -> list[str]:
    return [
        "--base-url", base,
        "--model", str(model),
        "--tokenizer", str(model),
        "--endpoint", "chat",
        "--concurrency", str(load["concurrency"]),
        "--requests", str(load["requests"]),
        "--prompt-tokens", str(load["prompt"]),
        "--output-tokens", str(load["output"]),
        "--seed", str(seed),
        "--label", label,
    ]  # fmt: skip


def run_bench(argv: list[str], progress: bool) -> dict:
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    args = p.parse_args(argv + ([] if progress else ["--no-progress"]))
    res = asyncio.run(bench_cli.bench(args))
    res.pop("_results", None)
    return res


def measure_load(server: Server, key: str, load: dict, rnd: int, progress: bool) -> dict:
    """One round of one load; every round of a load sends the same prompts (one seed per load,
    so no load reuses another's)."""
    label = f"{server.name} {key} r{rnd}"
    argv = bench_argv(server.base, server.model, load, label, 1 + list(LOADS).index(key))
    log(f"{label}: llmq bench {' '.join(argv)}")
    mark = server.sampler.mark()
    res = run_bench(argv, progress)
    res["resources"] = r = server.sampler.window(mark)
    res["command"] = "llmq bench " + " ".join(argv)
    res["round"] = rnd
    s = res["summary"]
    hit = s.get("cached_prompt_fraction")
    log(
        f"{label}: {s['output_tok_s']:.1f} tok/s, TTFT p50 {ms(s['ttft_s']['p50'])} ms, "
        f"p99 {ms(s['ttft_s']['p99'])} ms, ITL p50 {ms(s['itl_s']['p50'])} ms, errors "
        f"{s['errors']}, prompt tokens cached {'-' if hit is None else f'{hit:.0%}'}, peak RSS "
        f"{r['peak_rss_gib']:.2f} GiB (PSS {r['peak_pss_gib']:.2f}), server "
        f"{r['server_cores']:.2f} cores, machine "
        f"{r['machine_busy_cores']:.2f} cores busy"
    )
    return res


def measure_server(name: str, args, loads: dict[str, dict], log_dir: Path) -> dict:
    model = Path(args.model_dir).resolve()
    warm_conc = max(ld["concurrency"] for ld in loads.values())
    server = Server(
        name, model, log_dir, args.start_timeout, llmq_env(args.llmq_env), slots=warm_conc
    )
    out: dict = {"loads": {}}
    log(f"{name}: starting (log {server.log_path})")
    try:
        server.start()
        out["startup_s"] = server.startup_s
        log(f"{name}: ready in {server.startup_s:.0f}s; warming up")
        warm = {"concurrency": warm_conc, "prompt": 128, "output": 16, "requests": warm_conc}
        wres = run_bench(bench_argv(server.base, model, warm, f"{name} warm-up", 100), False)
        out["warmup"] = wres["summary"]
        out["idle_rss_gib"] = server.sampler.peak_kib / 2**20
        for key, load in loads.items():
            out["loads"][key] = [
                measure_load(server, key, load, rnd, args.progress)
                for rnd in range(1, args.rounds + 1)
            ]
    except Exception as exc:
        log(f"{name}: failed: {exc!r}\n{server.tail()}")
        out["error"] = repr(exc)
    finally:
        if server.sampler:
            server.sampler.sample()
            out["peak_rss_gib"] = server.sampler.peak_kib / 2**20
            out["peak_pss_gib"] = server.sampler.peak_pss_kib / 2**20
        log(f"{name}: stopping")
        t = time.perf_counter()
        server.stop()
        out["stop_s"] = time.perf_counter() - t
        log(f"{name}: stopped in {out['stop_s']:.1f}s")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="llmq vs vLLM (CPU), llama.cpp's server and transformers serve, one table."
    )
    p.add_argument(
        "--model-dir",
        default=str(ROOT / "bench/out/models/smollm2-135m"),
        help="model folder (built with make_model llama smollm2-135m if missing)",
    )
    p.add_argument(
        "--servers",
        default=DEFAULT_SERVERS,
        help=f"comma-separated, run in this order, from {', '.join(SERVERS)} "
        f"(default {DEFAULT_SERVERS})",
    )
    p.add_argument(
        "--loads",
        default="a,b,c",
        help="a: 32 x 128/64, b: 64 x 128/128, c: 1 x 128/64, d: 16 x 128/64 (default a,b,c)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every load's request count (at least its concurrency, c: 2)",
    )
    p.add_argument(
        "--requests", default="", help="request counts per load, e.g. a=32,b=64,c=4 (after --scale)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of each load, the same prompts each time; round 1 is the first sight of "
        "them, later rounds meet the prefix caches (2)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=900.0,
        help="seconds a server may take to become ready (the first start of a peer builds "
        "its venv, or llama-server) (900)",
    )
    p.add_argument(
        "--llmq-env",
        action="append",
        default=[],
        metavar="LLMQ_NAME=VALUE",
        help="a setting for the llmq server (repeatable); default: llmq up's own defaults",
    )
    p.add_argument("--progress", action="store_true", help="progress lines of each load")
    p.add_argument("--json", default=str(ROOT / "bench/out/compare.json"))
    p.add_argument("--png", default=str(ROOT / "bench/out/compare.png"))
    p.add_argument(
        "--chart-from",
        metavar="JSON",
        help="only draw the chart (--png) from an earlier run's JSON, measuring nothing",
    )
    return p


def pick_loads(p: argparse.ArgumentParser, args) -> dict[str, dict]:
    loads = {}
    for k in [k.strip() for k in args.loads.split(",") if k.strip()]:
        if k not in LOADS:
            p.error(f"unknown load {k!r}; choose from {', '.join(LOADS)}")
        load = dict(LOADS[k])
        load["requests"] = max(
            min(load["concurrency"], load["requests"]) if k != "c" else 2,
            round(load["requests"] * args.scale),
        )
        loads[k] = load
    for item in [x for x in args.requests.split(",") if x.strip()]:
        k, _, n = item.partition("=")
        if k.strip() in loads:
            loads[k.strip()]["requests"] = int(n)
    return loads


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.chart_from:
        report = json.loads(Path(args.chart_from).read_text())
        msg = chart(report["results"], report["config"]["loads"], Path(args.png), SERVERS)
        print(msg or f"wrote {args.png}")
        return 1 if msg else 0
    logging.basicConfig(level=logging.WARNING)
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    for s in servers:
        if s not in SERVERS:
            p.error(f"unknown server {s!r}; choose from {', '.join(SERVERS)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    loads = pick_loads(p, args)

    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        from llmq.tools.model_factory import make_model

        log(f"building the smollm2-135m-shaped model in {model}")
        make_model(model, arch="llama", size="smollm2-135m")
    log_dir = Path(args.json).parent / "compare-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log(
        f"model {model} (bfloat16), {cores()} cores, servers {', '.join(servers)}, loads "
        + ", ".join(
            f"{k}={v['concurrency']}x{v['prompt']}/{v['output']}*{v['requests']}"
            for k, v in loads.items()
        )
        + f", {args.rounds} round(s) each"
    )

    results: dict = {}
    started = time.time()
    for name in servers:
        results[name] = measure_server(name, args, loads, log_dir)
    text = table(results, loads, tuple(servers))
    print("\n" + text, flush=True)
    report = {
        "config": {
            "model": str(model.resolve()),
            "dtype": "bfloat16",
            "cores": cores(),
            "servers": servers,
            "loads": loads,
            "rounds": args.rounds,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "started": started,
        },
        "results": results,
        "table": text,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.json}")
    msg = chart(results, loads, Path(args.png), tuple(servers))
    log(msg or f"wrote {args.png}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
