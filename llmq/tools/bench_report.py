"""The statistics and the report of a `llmq bench` run: percentiles, the summary, the text
table and the plot."""

from __future__ import annotations

import math
from pathlib import Path

from llmq.tools.bench_load import RequestResult


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
    # Prompt tokens served by the server's prefix cache, where it reports any (llmq and vLLM
    # leave usage.prompt_tokens_details out of a request that had no hit: None counts as 0).
    reports_cache = any(r.cached_tokens is not None for r in ok)
    cached = [(r.cached_tokens or 0, r.prompt_tokens) for r in ok if r.prompt_tokens]
    cached = cached if reports_cache else []
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
        "cached_prompt_fraction": (
            sum(c for c, _ in cached) / sum(p for _, p in cached) if cached else None
        ),
        "requests_with_cache_hit": sum(1 for c, _ in cached if c) if cached else None,
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
    prompts = f"workload {c['workload']}" if c.get("workload") else f"{c['prompt_tokens']} in"
    lines = [
        f"{res['label']}: model {c['model']}, {c['endpoint']}, {load}, {c['requests']} requests, "
        f"{prompts} / {c['output_tokens']} out",
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
    if s.get("cached_prompt_fraction") is not None:
        lines.append(
            f"  prefix cache: {s['cached_prompt_fraction']:.0%} of prompt tokens, "
            f"{s['requests_with_cache_hit']} of {s['completed']} requests hit"
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
