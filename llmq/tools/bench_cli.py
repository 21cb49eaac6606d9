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

    llmq bench --base-url http://127.0.0.1:8000 --concurrency 32 --requests 64 \\
        --prompt-tokens 128 --output-tokens 64 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

EXTRA_FIELDS = ("min_tokens", "ignore_eos")


# ---- arguments -------------------------------------------------------------------------------
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
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (600)")
    p.add_argument("--json", dest="json_path", help="write the result as JSON to this file")
    p.add_argument("--plot", help="write a PNG of the latency distributions (needs matplotlib)")
    p.add_argument("--label", help="a name for this run in the output (default: the server URL)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")


# ---- prompts ---------------------------------------------------------------------------------
_WORDS: dict = {}


class BenchError(Exception):
    """The run cannot go on (no model listed, the first request failed)."""


class PromptBuilder:
    """Random prompts of an exact token count. Each word of the text is one vocabulary token
    with a leading space, so that the pre-tokenizer splits the text at every word and the count
    is the number of words (checked and corrected per prompt)."""

    def __init__(self, tokenizer, endpoint: str, seed: int):
        self.tok = tokenizer
        self.endpoint = endpoint
        self.rng = random.Random(seed)
        key = (id(tokenizer), len(tokenizer))
        if key not in _WORDS:
            _WORDS[key] = self._words()
        self.words = _WORDS[key]
        if not self.words:
            raise ValueError("the tokenizer has no single-token words to build prompts from")

    def _words(self) -> list[str]:
        vocab_size = len(self.tok)
        special = set(getattr(self.tok, "all_special_ids", []) or [])
        ids = [i for i in range(vocab_size) if i not in special]
        rng = random.Random(1234)
        if len(ids) > 20000:
            ids = rng.sample(ids, 20000)
        pieces = []
        for text in self.tok.batch_decode([[i] for i in ids]):
            word = text.strip()
            if 2 <= len(word) <= 12 and re.fullmatch(r"[A-Za-z]+", word):
                pieces.append(" " + word)
        pieces = sorted(set(pieces))
        enc = self.tok(pieces, add_special_tokens=False)["input_ids"]
        return [p for p, e in zip(pieces, enc, strict=True) if len(e) == 1]

    def count(self, text: str) -> int:
        if self.endpoint == "chat":
            ids = self.tok.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return len(ids)
        return len(self.tok.encode(text, add_special_tokens=True))

    def build(self, target: int) -> tuple[str, int]:
        """A prompt of ``target`` tokens (or the nearest reachable); returns it and its length."""
        overhead = self.count(self.words[0]) - 1
        n = max(1, target - overhead)
        words = [self.rng.choice(self.words) for _ in range(n)]
        best = None
        for _ in range(8):
            text = "".join(words).lstrip()
            got = self.count(text)
            if best is None or abs(got - target) < abs(best[1] - target):
                best = (text, got)
            if got == target:
                break
            if got < target:
                words += [self.rng.choice(self.words) for _ in range(target - got)]
            elif len(words) > 1:
                del words[max(1, len(words) - (got - target)) :]
        return best


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(path)


def fallback_prompt(target: int, rng: random.Random) -> str:
    """No tokenizer: about one token per short common word."""
    words = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as"]
    return " ".join(rng.choice(words) for _ in range(target))


# ---- one request -----------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool = False
    start: float = 0.0  # seconds from the run's start
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    chunks: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _chunk_text(obj: dict) -> str:
    out = []
    for choice in obj.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            out.append(delta.get("content") or "")
            out.append(delta.get("reasoning_content") or "")
        out.append(choice.get("text") or "")
    return "".join(out)


async def one_request(
    http: httpx.AsyncClient, url: str, body: dict, t0: float, timeout: float
) -> RequestResult:
    import httpx

    res = RequestResult()
    start = time.perf_counter()
    res.start = start - t0
    last = None
    usage_tokens = None
    try:
        async with http.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(data)
                except ValueError:
                    continue
                if "error" in obj and not obj.get("choices"):
                    err = obj["error"]
                    res.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    return res
                usage = obj.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                if _chunk_text(obj):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.chunks += 1
        end = time.perf_counter()
    except (httpx.HTTPError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = end - start
    res.output_tokens = usage_tokens if usage_tokens is not None else res.chunks
    if res.ttft is None:
        res.error = "no output"
        return res
    res.ok = True
    return res


# ---- the run ---------------------------------------------------------------------------------
class Progress:
    def __init__(self, total: int, enabled: bool, label: str = ""):
        self.total = total
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.label = label
        self.done = 0
        self.failed = 0
        self.tokens = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._last_decile = -1

    def update(self, res: RequestResult) -> None:
        if res.ok:
            self.done += 1
            self.tokens += res.output_tokens
        else:
            self.failed += 1
        self.draw()

    def draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        n = self.done + self.failed
        now = time.perf_counter()
        secs = now - self.t0
        rate = self.tokens / secs if secs > 0 else 0.0
        if self.tty:
            if not final and now - self._last < 0.2 and n < self.total:
                return
            self._last = now
            width = 30
            filled = int(width * n / self.total) if self.total else width
            sys.stderr.write(
                f"\r{self.label}[{'#' * filled}{'.' * (width - filled)}] {n}/{self.total} "
                f"({self.failed} failed) {secs:6.1f}s {rate:7.1f} tok/s "
            )
            if final:
                sys.stderr.write("\n")
        else:
            decile = n * 10 // self.total if self.total else 10
            if decile == self._last_decile and not final:
                return
            self._last_decile = decile
            sys.stderr.write(
                f"{self.label}{n}/{self.total} ({self.failed} failed) {secs:.1f}s "
                f"{rate:.1f} tok/s\n"
            )
        sys.stderr.flush()


async def run_load(
    http: httpx.AsyncClient,
    url: str,
    bodies: list[dict],
    concurrency: int | None,
    rate: float | None,
    seed: int,
    timeout: float,
    progress: Progress | None,
) -> tuple[list[RequestResult], float]:
    t0 = time.perf_counter()
    results: list[RequestResult | None] = [None] * len(bodies)

    async def do(i: int) -> None:
        res = await one_request(http, url, bodies[i], t0, timeout)
        results[i] = res
        if progress:
            progress.update(res)

    if rate:
        rng = random.Random(seed + 1)
        tasks = []
        at = 0.0
        for i in range(len(bodies)):
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(do(i)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    else:
        nxt = iter(range(len(bodies)))

        async def lane() -> None:
            for i in nxt:
                await do(i)

        await asyncio.gather(*(lane() for _ in range(min(concurrency or 1, len(bodies)) or 1)))
    return [r for r in results if r is not None], time.perf_counter() - t0


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in ps}, "n": 0}
    xs = sorted(values)
    out = {"mean": sum(xs) / len(xs)}
    for p in ps:
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    out["n"] = len(xs)
    return out


def summarize(results: list[RequestResult], duration: float, expected_tokens: int) -> dict:
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    messages: dict[str, int] = {}
    for r in errors:
        messages[r.error or "?"] = messages.get(r.error or "?", 0) + 1
    return {
        "duration_s": duration,
        "completed": len(ok),
        "errors": len(errors),
        "error_messages": dict(sorted(messages.items(), key=lambda kv: -kv[1])[:5]),
        "short_outputs": sum(1 for r in ok if r.output_tokens != expected_tokens),
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration if duration > 0 else 0.0,
        "requests_s": len(ok) / duration if duration > 0 else 0.0,
        "mean_prompt_tokens_reported": sum(prompt) / len(prompt) if prompt else None,
        "mean_chunks_per_request": sum(r.chunks for r in ok) / len(ok) if ok else None,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": percentiles([r.e2e for r in ok]),
    }


def _fmt_ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_result(res: dict) -> str:
    s = res["summary"]
    c = res["config"]
    load = f"rate {c['rate']}/s (Poisson)" if c["rate"] else f"concurrency {c['concurrency']}"
    lines = [
        f"{res['label']}: model {c['model']}, {c['endpoint']}, {load}, {c['requests']} requests, "
        f"{c['prompt_tokens']} in / {c['output_tokens']} out",
        f"  completed {s['completed']}, errors {s['errors']}, outputs not of the asked length "
        f"{s['short_outputs']}, {s['duration_s']:.2f} s",
        f"  output {s['output_tok_s']:.1f} tok/s, {s['requests_s']:.2f} requests/s, "
        f"{s['output_tokens']} output tokens",
        f"  {'ms':<6}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}",
    ]
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        d = s[key]
        lines.append(
            f"  {name:<6}{_fmt_ms(d['mean']):>9}{_fmt_ms(d['p50']):>9}{_fmt_ms(d['p90']):>9}"
            f"{_fmt_ms(d['p99']):>9}"
        )
    if c.get("extra_params_dropped"):
        lines.append("  note: the server rejected min_tokens/ignore_eos; sent without them")
    if c.get("prompt_note"):
        lines.append(f"  note: {c['prompt_note']}")
    for msg, n in s["error_messages"].items():
        lines.append(f"  error x{n}: {msg}")
    return "\n".join(lines)


def plot(res: dict, results: list[RequestResult], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no plot (pip install matplotlib)"
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    series = [
        ("TTFT (ms)", [r.ttft * 1000 for r in ok]),
        ("ITL (ms)", [x * 1000 for r in ok for x in r.itl]),
        ("end-to-end (s)", [r.e2e for r in ok]),
    ]
    for ax, (name, xs) in zip(axes, series, strict=False):
        if xs:
            ax.hist(xs, bins=min(50, max(5, len(xs) // 4)), color="tab:blue")
        ax.set_title(name)
        ax.set_ylabel("count")
    ax = axes[3]
    starts = sorted((r.start, r.start + r.e2e) for r in ok)
    for i, (a, b) in enumerate(starts):
        ax.plot([a, b], [i, i], color="tab:green", linewidth=1)
    ax.set_title("requests over time (s)")
    ax.set_ylabel("request")
    s = res["summary"]
    fig.suptitle(
        f"{res['label']}: {s['output_tok_s']:.1f} output tok/s, TTFT p50 "
        f"{_fmt_ms(s['ttft_s']['p50'])} ms, ITL p50 {_fmt_ms(s['itl_s']['p50'])} ms"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _v1(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


async def bench(args: argparse.Namespace) -> dict:
    import httpx

    base = _v1(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    inflight = args.concurrency or 1
    if args.rate:
        inflight = args.requests
    limits = httpx.Limits(max_connections=inflight + 8, max_keepalive_connections=inflight + 8)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout) as http:
        model = args.model
        if not model:
            r = await http.get(f"{base}/models", timeout=30)
            r.raise_for_status()
            data = r.json().get("data") or []
            if not data:
                raise BenchError(f"{base}/models lists no model")
            model = data[0]["id"]
        tok_path = args.tokenizer
        if not tok_path and Path(model).is_dir():
            tok_path = model
        rng = random.Random(args.seed)
        builder = None
        prompt_note = None
        if tok_path:
            builder = PromptBuilder(load_tokenizer(tok_path), args.endpoint, args.seed)
        else:
            prompt_note = "no tokenizer (--tokenizer): prompt lengths are approximate"
        total = args.requests + args.warmup
        prompts, lengths = [], []
        for _ in range(total):
            if builder:
                text, n = builder.build(args.prompt_tokens)
            else:
                text, n = fallback_prompt(args.prompt_tokens, rng), None
            prompts.append(text)
            lengths.append(n)
        if builder and any(n != args.prompt_tokens for n in lengths):
            prompt_note = (
                f"prompt lengths {min(lengths)}..{max(lengths)} (asked {args.prompt_tokens})"
            )

        path = "/chat/completions" if args.endpoint == "chat" else "/completions"
        url = base + path

        def body(prompt: str, max_tokens: int, extras: bool) -> dict:
            b: dict = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": args.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.endpoint == "chat":
                b["messages"] = [{"role": "user", "content": prompt}]
            else:
                b["prompt"] = prompt
            if extras:
                b["min_tokens"] = max_tokens
                b["ignore_eos"] = True
            return b

        # A probe: does the server take the extra fields? (and the first request, warmed)
        extras = not args.no_extra_params
        dropped = False
        probe = await one_request(
            http, url, body(prompts[0], 2, extras), time.perf_counter(), args.timeout
        )
        if not probe.ok and extras and probe.error and probe.error.startswith("HTTP 4"):
            retry = await one_request(
                http, url, body(prompts[0], 2, False), time.perf_counter(), args.timeout
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

        if args.warmup:
            warm = [body(p, min(args.output_tokens, 16), extras) for p in prompts[: args.warmup]]
            await run_load(http, url, warm, inflight, None, args.seed, args.timeout, None)

        bodies = [body(p, args.output_tokens, extras) for p in prompts[args.warmup :]]
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

    res = {
        "label": args.label or args.base_url,
        "config": {
            "base_url": args.base_url,
            "model": model,
            "endpoint": args.endpoint,
            "concurrency": None if args.rate else (args.concurrency or 1),
            "rate": args.rate,
            "requests": args.requests,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "warmup": args.warmup,
            "tokenizer": tok_path,
            "extra_params_sent": extras,
            "extra_params_dropped": dropped,
            "prompt_lengths": [min(lengths), max(lengths)] if builder else None,
            "prompt_note": prompt_note,
        },
        "summary": summarize(results, duration, args.output_tokens),
    }
    res["_results"] = results
    return res


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
        args.api_key = args.api_key or s.api_key
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if args.requests < 1 or (args.concurrency is not None and args.concurrency < 1):
        raise SystemExit("--requests and --concurrency must be at least 1")
    if args.rate is not None and args.rate <= 0:
        raise SystemExit("--rate must be positive")
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
        print(format_result(res), flush=True)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(res, indent=2) + "\n")
    if args.plot:
        msg = plot(res, results, args.plot)
        if msg:
            print(f"note: {msg}", file=sys.stderr)
    s = res["summary"]
    return 0 if s["completed"] and not s["errors"] else 1
