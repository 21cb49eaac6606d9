"""`llmq bench`: a load generator for any OpenAI-compatible server (llmq, vLLM, transformers serve).

Each request streams (``stream=true`` with ``stream_options.include_usage``); the client stamps
every chunk as it arrives, which gives the time to first token (TTFT: first chunk with text),
the inter-token latency (ITL: gaps between text chunks, as vLLM's benchmark counts it), the time
per output token after the first (TPOT) and the end-to-end latency of each request. Output tokens
come from the final usage chunk where the server sends one, else from the number of text chunks.

Prompts are random words of exactly ``--prompt-tokens`` tokens (chat template included for the
chat endpoint) when a tokenizer is at hand: ``--tokenizer``, or the model folder when the model
is a local path. ``max_tokens`` with ``min_tokens`` and ``ignore_eos`` make every request generate
exactly ``--output-tokens`` on servers that honour them; a server that rejects those fields is
asked once more without them (and the result says so).

Load: ``--concurrency N`` keeps N requests in flight (closed loop); ``--rate R`` sends requests
at Poisson arrivals of R per second whatever the server does (open loop).

``--workload NAME`` sends the chats of speculative decoding's benchmark instead (a function to
edit, a document to quote, ...; ``llmq/tools/bench_workloads.py``), each to its natural end or
``--output-tokens``; ``--no-speculative`` asks llmq to run no speculative decoding for the
requests. Where the server is llmq and its workers speculate, the report gives the run's
acceptance and mean tokens per checking step (from /metrics).

    llmq bench --base-url http://127.0.0.1:8000 --concurrency 32 --requests 64 \\
        --prompt-tokens 128 --output-tokens 64 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llmq.tools.bench_load import Progress, RequestResult, RequestShape, one_request, run_load
from llmq.tools.bench_prompts import PromptSet, build_prompts
from llmq.tools.bench_report import format_result, plot, summarize
from llmq.tools.bench_spec import (
    WORKLOADS,
    format_spec,
    spec_figures,
    totals_after,
    workload_prompts,
)

if TYPE_CHECKING:
    import httpx


class BenchError(Exception):
    """The run cannot go on (no model listed, the first request failed)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="load generator against any OpenAI-compatible server (llmq, vLLM, ...)",
        description="Streams requests of fixed prompt and output length to an OpenAI-compatible "
        "server, closed loop (--concurrency) or open loop (--rate), and reports TTFT, ITL and "
        "end-to-end percentiles, output tokens/s, requests/s and errors.",
    )
    add_arguments(p)
    p.set_defaults(func=run, parser=p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url",
        default=None,
        help="server URL, with or without /v1 (default http://LLMQ_HOST:LLMQ_PORT)",
    )
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", help="bearer token (default LLMQ_API_KEY, then OPENAI_API_KEY)")
    p.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="/v1/chat/completions (chat, default) or /v1/completions",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=int, help="closed loop: requests in flight at once (default 1)"
    )
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests per second")
    p.add_argument("--requests", type=int, default=64, help="requests measured (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (128)")
    p.add_argument(
        "--output-tokens", type=int, default=64, help="tokens generated per request (64)"
    )
    p.add_argument(
        "--tokenizer",
        help="tokenizer folder or id used to build prompts of exact length "
        "(default: the model folder when the model is a local path)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (0)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="requests sent (and not measured) before the run, at the same concurrency (0)",
    )
    p.add_argument(
        "--no-extra-params",
        action="store_true",
        help="do not send min_tokens / ignore_eos (servers that reject unknown fields)",
    )
    add_content_arguments(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (600)")
    p.add_argument("--json", dest="json_path", help="write the result as JSON to this file")
    p.add_argument("--plot", help="write a PNG of the latency distributions (needs matplotlib)")
    p.add_argument("--label", help="a name for this run in the output (default: the server URL)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")


def add_content_arguments(p: argparse.ArgumentParser) -> None:
    """What the requests hold beyond random prompts: workloads, images, speculation."""
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="send this workload's chats (speculative decoding's benchmark) instead of random "
        "prompts, without min_tokens/ignore_eos; --prompt-tokens does not apply",
    )
    p.add_argument(
        "--no-speculative",
        action="store_true",
        help='ask for no speculative decoding ("speculative": false, llmq\'s field)',
    )
    p.add_argument(
        "--images", type=int, default=0, help="images of random pixels in each chat request (0)"
    )
    p.add_argument(
        "--image-size", default="640x480", help="their width x height in pixels (640x480)"
    )


def _v1(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _in_flight(args: argparse.Namespace) -> int:
    """Requests in flight at most: the concurrency, or every request at an open-loop rate."""
    return args.requests if args.rate else (args.concurrency or 1)


async def _first_model(http: httpx.AsyncClient, base: str) -> str:
    r = await http.get(f"{base}/models", timeout=30)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise BenchError(f"{base}/models lists no model")
    return data[0]["id"]


async def _probe(
    http: httpx.AsyncClient, url: str, shape: RequestShape, prompt, args: argparse.Namespace
) -> tuple[bool, bool]:
    """A first short request (which also warms the server): does it take the extra fields?
    Returns (extras sent, extras dropped after a refusal)."""
    # A workload's chats run to their own end: whether the model copies, then stops.
    extras = not args.no_extra_params and not args.workload
    dropped = False
    probe = await one_request(
        http, url, shape.body(prompt, 2, extras), time.perf_counter(), args.timeout
    )
    if not probe.ok and extras and probe.error and probe.error.startswith("HTTP 4"):
        retry = await one_request(
            http, url, shape.body(prompt, 2, False), time.perf_counter(), args.timeout
        )
        if retry.ok:
            extras, dropped = False, True
            if not args.quiet:
                print(
                    f"note: the server rejected min_tokens/ignore_eos ({probe.error[:120]}); "
                    "sending without them",
                    file=sys.stderr,
                )
        probe = retry
    if not probe.ok:
        raise BenchError(f"the first request failed: {probe.error}")
    return extras, dropped


async def _measure(
    http: httpx.AsyncClient,
    url: str,
    shape: RequestShape,
    prompts: PromptSet,
    extras: bool,
    args: argparse.Namespace,
) -> tuple[list[RequestResult], float]:
    """The warm-up requests (unmeasured), then the measured run: its results and duration."""
    if args.warmup:
        warm_tokens = min(args.output_tokens, 16)
        warm = [shape.body(p, warm_tokens, extras) for p in prompts.texts[: args.warmup]]
        await run_load(http, url, warm, _in_flight(args), None, args.seed, args.timeout, None)
    bodies = [shape.body(p, args.output_tokens, extras) for p in prompts.texts[args.warmup :]]
    progress = Progress(
        len(bodies),
        not args.no_progress and not args.quiet,
        f"{args.label} " if args.label else "",
    )
    results, duration = await run_load(
        http,
        url,
        bodies,
        None if args.rate else (args.concurrency or 1),
        args.rate,
        args.seed,
        args.timeout,
        progress,
    )
    progress.draw(final=True)
    return results, duration


def _config(
    args: argparse.Namespace,
    model: str,
    tokenizer: str | None,
    prompts: PromptSet,
    extras: bool,
    dropped: bool,
) -> dict:
    """The run's settings as the result reports them."""
    return {
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "concurrency": None if args.rate else (args.concurrency or 1),
        "rate": args.rate,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "temperature": args.temperature,
        "images": args.images,
        "image_size": args.image_size if args.images else None,
        "seed": args.seed,
        "warmup": args.warmup,
        "tokenizer": tokenizer,
        "extra_params_sent": extras,
        "extra_params_dropped": dropped,
        "workload": args.workload,
        "speculative": not args.no_speculative,
        "prompt_lengths": prompts.length_range,
        "prompt_note": prompts.note,
    }


async def bench(args: argparse.Namespace) -> dict:
    """One run: its label, config and summary, and its per-request results under ``_results``."""
    import httpx

    base = _v1(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    inflight = _in_flight(args)
    limits = httpx.Limits(max_connections=inflight + 8, max_keepalive_connections=inflight + 8)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout) as http:
        model = args.model or await _first_model(http, base)
        tokenizer = args.tokenizer
        if not tokenizer and Path(model).is_dir():
            tokenizer = model
        count = args.requests + args.warmup
        if args.workload:
            prompts = workload_prompts(args.workload, count)
        else:
            prompts = build_prompts(tokenizer, args.endpoint, args.seed, count, args.prompt_tokens)
        width, height = map(int, args.image_size.lower().split("x"))
        size, speculative = (width, height), not args.no_speculative
        shape = RequestShape(model, args.endpoint, args.temperature, args.images, size, speculative)
        url = base + shape.path
        root = base.removesuffix("/v1")
        before = await totals_after(http, root, model, time.time())
        extras, dropped = await _probe(http, url, shape, prompts.texts[0], args)
        results, duration = await _measure(http, url, shape, prompts, extras, args)
        spec = spec_figures(before, await totals_after(http, root, model, time.time()))
    summary = summarize(results, duration, args.output_tokens) | {"speculative": spec}
    return {
        "label": args.label or args.base_url,
        "config": _config(args, model, tokenizer, prompts, extras, dropped),
        "summary": summary,
        "_results": results,
    }


def httpx_errors() -> tuple[type[BaseException], ...]:
    import httpx

    return (httpx.HTTPError,)


def run(args: argparse.Namespace) -> int:
    import logging

    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.base_url is None:
        from llmq.common.settings import get_settings

        s = get_settings()
        args.base_url = f"http://{s.host}:{s.port}"
        args.api_key = args.api_key or next(iter(s.api_keys()), None)
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if args.requests < 1 or (args.concurrency is not None and args.concurrency < 1):
        raise SystemExit("--requests and --concurrency must be at least 1")
    if args.rate is not None and args.rate <= 0:
        raise SystemExit("--rate must be positive")
    if args.workload and args.endpoint != "chat":
        raise SystemExit("--workload sends chats: --endpoint chat")
    try:
        res = asyncio.run(bench(args))
    except BenchError as exc:
        print(f"llmq bench: {exc}", file=sys.stderr)
        return 1
    except httpx_errors() as exc:
        response = getattr(exc, "response", None)  # HTTPStatusError: it answered, with an error
        if response is not None:
            why = f"{args.base_url} answered {response.status_code}: {response.text[:300]}"
        else:
            why = f"cannot reach {args.base_url}: {exc}"
        print(f"llmq bench: {why}", file=sys.stderr)
        return 1
    results = res.pop("_results")
    if not args.quiet:
        lines = [format_result(res), *format_spec(res["summary"]["speculative"])]
        print("\n".join(lines), flush=True)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(res, indent=2) + "\n")
    if args.plot:
        msg = plot(res, results, args.plot)
        if msg:
            print(f"note: {msg}", file=sys.stderr)
    s = res["summary"]
    return 0 if s["completed"] and not s["errors"] else 1
