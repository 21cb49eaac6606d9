"""Structured output against the same load unconstrained, in one run.

Starts ``llmq up`` on a model folder (default bench/out/models/smollm2-135m, bfloat16; or uses a
running server with --base-url) and drives it with rounds of chat requests that alternate:
plain, then the same load with one ``json_schema`` ``response_format`` (an order with at least
40 line items, so that no constrained answer can end before --output-tokens), then plain again,
and so on. Each round streams --requests requests, --concurrency at a time (32), through the
same load code as ``llmq bench``. It prints, for each kind of round, the output tok/s (and the
constrained/plain ratio), TTFT and ITL p50/p99, the server tree's peak RSS and CPU time per
output token, and the grammar build time: the TTFT of a lone request with a schema the server
has not seen against the same schema again (the engine keeps each grammar's matcher) and
against a plain request.

The engine does not report the mask's own CPU cost per token; the CPU per output token of the
server tree (API, worker and Redis together), constrained against plain, bounds it from above.

    .venv/bin/llmq make-model bench/out/models/smollm2-135m --arch llama --size smollm2-135m
    .venv/bin/python bench/structured.py                       # starts llmq up
    .venv/bin/python bench/structured.py --rounds 2 --requests 32
    .venv/bin/python bench/structured.py --base-url http://127.0.0.1:8000   # a running llmq

Not a test: it takes minutes and its figures depend on the machine; compare ratios, not
absolute figures, and only within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from compare import ROOT, Server, llmq_env, log, ms  # bench/compare.py, beside this file

from llmq.tools.bench_load import RequestShape, one_request, run_load
from llmq.tools.bench_prompts import build_prompts
from llmq.tools.bench_report import summarize

SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 32},
        "priority": {"type": "string", "enum": ["low", "normal", "urgent"]},
        "lines": {
            "type": "array",
            "minItems": 40,
            "maxItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "qty", "gift"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["customer", "priority", "lines"],
    "additionalProperties": False,
}
KINDS = ("plain", "json_schema")


def response_format(schema: dict, name: str = "order") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def fresh_schema(n: int) -> dict:
    """SCHEMA with one more optional property: a grammar no cache has seen."""
    schema = copy.deepcopy(SCHEMA)
    schema["properties"][f"note_{n}_{time.time_ns()}"] = {"type": "string", "maxLength": 8}
    return schema


@dataclass
class Rounds:
    """The summaries of each kind's rounds, and the server's figures over them."""

    summaries: dict[str, list[dict]] = field(default_factory=lambda: {k: [] for k in KINDS})
    resources: dict[str, list[dict]] = field(default_factory=lambda: {k: [] for k in KINDS})


# ---- the load --------------------------------------------------------------------------------
def bodies(model: str, args, seed: int, constrained: bool) -> list[dict]:
    prompts = build_prompts(args.tokenizer, "chat", seed, args.requests, args.prompt_tokens)
    shape = RequestShape(model, "chat", 0.0)
    extra = {"response_format": response_format(SCHEMA)} if constrained else {}
    return [shape.body(p, args.output_tokens, True) | extra for p in prompts.texts]


async def run_round(url: str, load: list[dict], args, seed: int) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as http:
        results, duration = await run_load(
            http, url, load, args.concurrency, None, seed, args.timeout, None
        )
    return summarize(results, duration, args.output_tokens)


def run_rounds(url: str, model: str, args, server: Server | None) -> Rounds:
    """Plain and constrained rounds, alternating; a seed per round so that no round reuses
    another's prompts (no prefix-cache hits)."""
    out = Rounds()
    for r in range(args.rounds):
        for k, kind in enumerate(KINDS):
            seed = 10 + 2 * r + k
            load = bodies(model, args, seed, kind == "json_schema")
            mark = server.sampler.mark() if server else None
            s = asyncio.run(run_round(url, load, args, seed))
            out.summaries[kind].append(s)
            if server:
                out.resources[kind].append(server.sampler.window(mark))
            log(
                f"round {r + 1} {kind}: {s['output_tok_s']:.1f} tok/s, TTFT p50 "
                f"{ms(s['ttft_s']['p50'])} ms, ITL p50 {ms(s['itl_s']['p50'])} ms, "
                f"errors {s['errors']}, short outputs {s['short_outputs']}"
            )
            if s["errors"]:
                log(f"  errors: {s['error_messages']}")
    return out


# ---- grammar build time ----------------------------------------------------------------------
async def lone_ttft(http: httpx.AsyncClient, url: str, body: dict, timeout: float) -> float:
    res = await one_request(http, url, body, time.perf_counter(), timeout)
    if not res.ok:
        raise RuntimeError(f"a lone request failed: {res.error}")
    return res.ttft


async def grammar_build(url: str, model: str, args) -> dict:
    """Median TTFT of a lone request: a new schema, the same schema again, and no schema."""
    prompt = build_prompts(args.tokenizer, "chat", 99, 1, args.prompt_tokens).texts[0]
    shape = RequestShape(model, "chat", 0.0)
    ttft: dict[str, list[float]] = {"new schema": [], "same schema again": [], "plain": []}
    async with httpx.AsyncClient(timeout=args.timeout) as http:
        for n in range(args.build_probes):
            fmt = {"response_format": response_format(fresh_schema(n))}
            for key in ("new schema", "same schema again"):
                body = shape.body(prompt, 4, True) | fmt
                ttft[key].append(await lone_ttft(http, url, body, args.timeout))
            ttft["plain"].append(await lone_ttft(http, url, shape.body(prompt, 4, True), 60))
    return {k: statistics.median(v) for k, v in ttft.items()}


# ---- the report ------------------------------------------------------------------------------
def pooled(summaries: list[dict], key: str, p: str) -> float | None:
    """The median over rounds of one percentile (rounds have equal weight)."""
    values = [s[key][p] for s in summaries if s[key].get(p) is not None]
    return statistics.median(values) if values else None


def kind_figures(summaries: list[dict], resources: list[dict]) -> dict:
    tokens = sum(s["output_tokens"] for s in summaries)
    duration = sum(s["duration_s"] for s in summaries)
    figures = {
        "output_tok_s": tokens / duration if duration else 0.0,
        "ttft_p50_s": pooled(summaries, "ttft_s", "p50"),
        "ttft_p99_s": pooled(summaries, "ttft_s", "p99"),
        "itl_p50_s": pooled(summaries, "itl_s", "p50"),
        "itl_p99_s": pooled(summaries, "itl_s", "p99"),
        "errors": sum(s["errors"] for s in summaries),
        "short_outputs": sum(s["short_outputs"] for s in summaries),
    }
    if resources:
        cpu_s = sum(r["server_cpu_s"] for r in resources)
        figures["peak_rss_gib"] = max(r["peak_rss_gib"] for r in resources)
        figures["server_cpu_ms_per_token"] = 1000 * cpu_s / tokens if tokens else None
        busy = [r["machine_busy_cores"] for r in resources if r["machine_busy_cores"] is not None]
        figures["machine_busy_cores"] = statistics.mean(busy) if busy else None
    return figures


def table(figures: dict[str, dict], build: dict) -> str:
    plain, constrained = figures["plain"], figures["json_schema"]
    rows = [
        ("output tok/s", "output_tok_s", "{:.1f}", 1),
        ("TTFT p50 ms", "ttft_p50_s", "{:.0f}", 1000),
        ("TTFT p99 ms", "ttft_p99_s", "{:.0f}", 1000),
        ("ITL p50 ms", "itl_p50_s", "{:.1f}", 1000),
        ("ITL p99 ms", "itl_p99_s", "{:.1f}", 1000),
        ("peak RSS GiB", "peak_rss_gib", "{:.2f}", 1),
        ("server CPU ms/token", "server_cpu_ms_per_token", "{:.2f}", 1),
        ("machine busy cores", "machine_busy_cores", "{:.2f}", 1),
        ("errors", "errors", "{}", 1),
        ("short outputs", "short_outputs", "{}", 1),
    ]
    lines = [f"{'':22}{'plain':>12}{'json_schema':>14}{'ratio':>9}"]
    for label, key, fmt, scale in rows:
        a, b = plain.get(key), constrained.get(key)
        if a is None and b is None:
            continue
        cells = ["-" if v is None else fmt.format(v * scale) for v in (a, b)]
        ratio = f"{b / a:.2f}x" if a and b is not None and key != "errors" else ""
        lines.append(f"{label:22}{cells[0]:>12}{cells[1]:>14}{ratio:>9}")
    lines.append("grammar build (TTFT of a lone request, median):")
    for key, value in build.items():
        lines.append(f"  {key:20}{value * 1000:8.1f} ms")
    extra = build["new schema"] - build["same schema again"]
    lines.append(f"  {'a new schema costs':20}{extra * 1000:8.1f} ms more")
    return "\n".join(lines)


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="json_schema response_format against plain, one run.")
    p.add_argument("--model-dir", default=str(ROOT / "bench/out/models/smollm2-135m"))
    p.add_argument("--base-url", help="a running llmq (no RSS or CPU figures); default: llmq up")
    p.add_argument("--concurrency", type=int, default=32, help="streams in flight (32)")
    p.add_argument("--requests", type=int, default=64, help="requests per round (64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each kind, alternating (3)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--build-probes", type=int, default=5, help="new schemas timed (5)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--llmq-env", action="append", default=[], metavar="LLMQ_NAME=VALUE")
    p.add_argument("--json", default=str(ROOT / "bench/out/structured.json"))
    return p.parse_args(argv)


def measure(url: str, model: str, args, server: Server | None) -> dict:
    log("warm-up: one plain and one constrained round of --concurrency requests")
    for constrained in (False, True):
        warm = bodies(model, args, 1, constrained)[: args.concurrency]
        for b in warm:
            b["max_tokens"] = b["min_tokens"] = 8
        asyncio.run(run_round(url, warm, args, 1))
    build = asyncio.run(grammar_build(url, model, args))
    rounds = run_rounds(url, model, args, server)
    figures = {k: kind_figures(rounds.summaries[k], rounds.resources[k]) for k in KINDS}
    return {
        "figures": figures,
        "grammar_build_ttft_s": build,
        "rounds": rounds.summaries,
        "resources": rounds.resources,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    args.tokenizer = args.model_dir
    server = None
    if args.base_url is None:
        server = Server(
            "llmq", Path(args.model_dir).resolve(), Path(args.json).parent, args.start_timeout,
            llmq_env(args.llmq_env),
        )  # fmt: skip
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        log(f"llmq: starting (log {server.log_path})")
        server.start()
    base = (args.base_url or server.base).rstrip("/").removesuffix("/v1") + "/v1"
    try:
        model = httpx.get(f"{base}/models", timeout=30).json()["data"][0]["id"]
        out = measure(f"{base}/chat/completions", model, args, server)
    finally:
        if server:
            server.stop()
    print(table(out["figures"], out["grammar_build_ttft_s"]))
    out["command"] = " ".join(sys.argv)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if not any(f["errors"] for f in out["figures"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
