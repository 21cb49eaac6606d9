"""What a large batch costs the worker that holds the model: a 50,000-line batch (a tiny random
model, max_tokens 1) through a real redis-server, `llmq worker` and `llmq api`, driven by the
openai client. Reports the worker's peak RSS growth over its idle RSS while the batch runs
(sampled from /proc every 50 ms: the batch task runs in the worker's process, beside the
engine) and the lines per second from upload to completed.

    .venv/bin/python bench/batch_memory.py                 # 50,000 lines (a few minutes on a CPU)
    .venv/bin/python bench/batch_memory.py --lines 5000    # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss(pid: int) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) * 1024
    return 0


class PeakRss:
    """The highest RSS of a process while running, sampled on a thread."""

    def __init__(self, pid: int, every: float = 0.05):
        self.pid, self.every, self.peak = pid, every, rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, rss(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def batch_input(model: str, lines: int) -> bytes:
    rows = []
    for i in range(lines):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"line {i}: say something"}],
            "max_tokens": 1,
            "temperature": 0,
        }
        row = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        rows.append(json.dumps(row))
    return ("\n".join(rows) + "\n").encode()


def run(lines: int, concurrency: int, workdir: Path) -> dict:
    import openai

    from llmq.common.transport.redis_server import RedisServer
    from llmq.tools.model_factory import make_model
    from tests.harness import start_api, start_worker

    model = str(make_model(workdir / "tiny", arch="llama", size="tiny"))
    with RedisServer() as server:
        worker = start_worker(
            server.url, model, "bench-batch", workdir, batch_concurrency=concurrency
        )
        api, base = start_api(server.url, model, workdir, "api-bench")
        try:
            client = openai.OpenAI(
                base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600
            )
            content = batch_input(model, lines)
            time.sleep(2)  # the worker settled after start
            idle = rss(worker.proc.pid)
            t0 = time.monotonic()
            with PeakRss(worker.proc.pid) as peak:
                f = client.files.create(file=("bench.jsonl", content), purpose="batch")
                b = client.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                while (b := client.batches.retrieve(b.id)).status not in (
                    "completed",
                    "failed",
                    "cancelled",
                    "expired",
                ):
                    time.sleep(1)
            took = time.monotonic() - t0
            out = client.files.content(b.output_file_id).content if b.output_file_id else b""
            return {
                "lines": lines,
                "input_bytes": len(content),
                "status": b.status,
                "completed": b.request_counts.completed,
                "failed": b.request_counts.failed,
                "output_lines": out.count(b"\n"),
                "seconds": round(took, 1),
                "lines_per_s": round(lines / took, 1),
                "worker_idle_rss_mib": round(idle / 2**20, 1),
                "worker_peak_rss_growth_mib": round((peak.peak - idle) / 2**20, 1),
                "batch_concurrency": concurrency,
            }
        finally:
            api.terminate()
            worker.terminate()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=50_000)
    p.add_argument("--concurrency", type=int, default=4, help="LLMQ_BATCH_CONCURRENCY")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.lines, args.concurrency, Path(tmp))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
