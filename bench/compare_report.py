"""bench/compare.py's table and chart: one row per load, round and server, and llmq's ratio to
each peer in the same round."""

from __future__ import annotations

from pathlib import Path

COLUMNS = [
    ("output tok/s", lambda s, r: s["output_tok_s"], "{:.1f}"),
    ("TTFT p50 ms", lambda s, r: s["ttft_s"]["p50"], "ms"),
    ("TTFT p99 ms", lambda s, r: s["ttft_s"]["p99"], "ms"),
    ("ITL p50 ms", lambda s, r: s["itl_s"]["p50"], "ms"),
    ("ITL p99 ms", lambda s, r: s["itl_s"]["p99"], "ms"),
    ("peak RSS GiB", lambda s, r: r["peak_rss_gib"], "{:.2f}"),
    ("peak PSS GiB", lambda s, r: r.get("peak_pss_gib"), "{:.2f}"),
]
COLORS = {
    "llmq": "tab:blue",
    "vllm": "tab:orange",
    "llamacpp": "tab:red",
    "transformers": "tab:green",
}


def ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _cell(v, fmt) -> str:
    if v is None:
        return "-"
    return ms(v) if fmt == "ms" else fmt.format(v)


def rounds(res) -> list[dict]:
    """A load's rounds (a JSON written before rounds existed holds one result, not a list)."""
    if not res:
        return []
    return res if isinstance(res, list) else [res]


def _ratio_line(mine: list, theirs: list, label: str, w: int) -> str:
    cells = ""
    for a, b in zip(mine, theirs, strict=True):
        cells += f"{(a / b if a is not None and b else float('nan')):>{w - 1}.2f}x"
    return f"{'':<30}{label:<18}{cells}"


def _load_rows(results: dict, servers: list[str], key: str, load: dict, w: int) -> list[str]:
    lines = []
    n = max(len(rounds(results[s].get("loads", {}).get(key))) for s in servers)
    for i in range(max(n, 1)):
        desc = f"({key}) {load['concurrency']} x {load['prompt']}/{load['output']}, r{i + 1}"
        rows = {}
        for name in servers:
            got = rounds(results[name].get("loads", {}).get(key))
            if i >= len(got):
                lines.append(f"{desc:<30}{name:<18}failed: {results[name].get('error', '?')}")
                desc = ""
                continue
            s, r = got[i]["summary"], got[i]["resources"]
            rows[name] = [f(s, r) for _, f, _ in COLUMNS]
            cells = "".join(
                f"{_cell(v, fmt):>{w}}" for v, (_, _, fmt) in zip(rows[name], COLUMNS, strict=True)
            )
            lines.append(
                f"{desc:<30}{name:<18}{cells}{s['errors']:>8}"
                f"{r['server_cores']:>10.2f}{r['machine_busy_cores']:>6.1f}"
            )
            desc = ""
        for peer in [p for p in servers if p != "llmq" and p in rows and "llmq" in rows]:
            lines.append(_ratio_line(rows["llmq"], rows[peer], f"llmq / {peer}", w))
    return lines


def table(results: dict, loads: dict, order: tuple[str, ...]) -> str:
    servers = [s for s in order if s in results]
    w = 14
    head = f"{'load, round':<30}{'server':<18}" + "".join(f"{c[0]:>{w}}" for c in COLUMNS)
    head += f"{'errors':>8}{'srv cores':>10}{'busy':>6}"
    lines = [head, "-" * len(head)]
    for key, load in loads.items():
        lines += _load_rows(results, servers, key, load, w)
    for name in servers:
        res = results[name]
        lines.append(
            f"{name}: ready in {_cell(res.get('startup_s'), '{:.0f}')} s, RSS after warm-up "
            f"{_cell(res.get('idle_rss_gib'), '{:.2f}')} GiB, peak RSS of the whole run "
            f"{_cell(res.get('peak_rss_gib'), '{:.2f}')} GiB (PSS "
            f"{_cell(res.get('peak_pss_gib'), '{:.2f}')} GiB)"
        )
    lines += [
        "r1: the load's prompts sent for the first time; r2: the same prompts again (prefix "
        "caches: llmq's and vLLM's block caches, llama.cpp's per-slot prompt).",
        "ratios are llmq / peer: above 1 is better for output tok/s, below 1 is better for "
        "latency and memory. peak RSS: VmRSS summed over the server's process tree, every 0.5 s; "
        "PSS: the same with each page shared by n processes (libraries, a file's mapping) "
        "counted 1/n in each, so once in all.",
        "srv cores: CPU the server's process tree used per wall second during the load; busy: "
        "all cores busy per wall second on the machine (client and other tenants included)",
    ]
    return "\n".join(lines)


def _bars(ax, results: dict, servers: list[str], keys: list[str], f) -> None:
    width = 0.8 / max(1, len(servers))
    for i, name in enumerate(servers):
        vals = []
        for k in keys:
            got = rounds(results[name]["loads"].get(k))
            vals.append(f(got[0]["summary"], got[0]["resources"]) if got else 0)
        xs = [j + (i - (len(servers) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, vals, width, label=name, color=COLORS.get(name))


def chart(results: dict, loads: dict, path: Path, order: tuple[str, ...]) -> str | None:
    """Bars of each load's first round (repeated prompts favour whoever caches them)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no chart (pip install matplotlib)"
    servers = [s for s in order if s in results and results[s].get("loads")]
    keys = list(loads)
    metrics = [
        ("output tok/s", lambda s, r: s["output_tok_s"]),
        ("TTFT p50 (s)", lambda s, r: s["ttft_s"]["p50"]),
        ("ITL p50 (ms)", lambda s, r: (s["itl_s"]["p50"] or 0) * 1000),
        ("peak RSS (GiB)", lambda s, r: r["peak_rss_gib"]),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8))
    for ax, (title, f) in zip(axes, metrics, strict=True):
        _bars(ax, results, servers, keys, f)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(
            [
                f"({k}) {loads[k]['concurrency']}x{loads[k]['prompt']}/{loads[k]['output']}"
                for k in keys
            ],
            fontsize=8,
        )
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle("llmq vs peers, same model folder and cores (bfloat16), first round")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
