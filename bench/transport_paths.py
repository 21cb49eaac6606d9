"""The two paths bench/transport.py times (the engine in this process; the same load through
Redis and a `llmq worker` process) and the CPU meter it reads them with."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class CpuMeter:
    """CPU seconds used per wall second, from now to ``read``: by the worker process, by this
    process (client and in-process engine) and by the whole machine."""

    def __init__(self, worker_pid: int):
        self.pid = worker_pid
        self.w0 = _ticks(worker_pid)
        self.me0 = time.process_time()
        self.m0 = _machine_busy()
        self.t0 = time.perf_counter()
        self.text = ""

    def read(self, secs: float | None = None) -> dict:
        wall = time.perf_counter() - self.t0
        clk = os.sysconf("SC_CLK_TCK")
        out = {
            "worker_cores": (_ticks(self.pid) - self.w0) / clk / wall,
            "this_process_cores": (time.process_time() - self.me0) / wall,
            "machine_busy_cores": (_machine_busy() - self.m0) / clk / wall,
        }
        self.text = (
            f"[cores: worker {out['worker_cores']:.2f}, this process "
            f"{out['this_process_cores']:.2f}, machine {out['machine_busy_cores']:.2f}]"
        )
        return out


def _ticks(pid: int) -> int:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    rest = raw[raw.rindex(")") + 2 :].split()
    return int(rest[11]) + int(rest[12])


def _machine_busy() -> int:
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(parts) - parts[3] - parts[4]


# ---- in-process ------------------------------------------------------------------------------
class InProcess:
    def __init__(self, model_dir: Path, dtype: str, settings):
        from llmq.common.model_files import load_tokenizer
        from llmq.worker.llm_engine import EngineConfig, LLMEngine
        from llmq.worker.loading.model_loader import eos_token_ids, load_causal_lm

        model = load_causal_lm(str(model_dir), dtype, "cpu")
        tok = load_tokenizer(str(model_dir))
        self.engine = LLMEngine(
            model, EngineConfig.from_settings(settings), eos_token_ids(model, tok)
        )
        self.vocab = model.config.get_text_config().vocab_size
        self._n = 0
        # The engine runs on one long-lived thread of its own, as in the worker (the
        # "llmq-engine" thread), so that the two paths differ only by Redis and the pipeline.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def close(self) -> None:
        self._thread.shutdown()

    def run(self, prompts: list[list[int]], params) -> tuple[float, int]:
        e = self.engine
        t = time.perf_counter()
        for p in prompts:
            self._n += 1
            e.add_request(f"r{self._n}", p, params)
        tokens = 0
        while e.has_unfinished():
            for o in e.step():
                tokens += len(o.token_ids)
        return time.perf_counter() - t, tokens

    def ttft(self, prompt: list[int], params) -> float:
        e = self.engine
        self._n += 1
        rid = f"t{self._n}"
        t = time.perf_counter()
        e.add_request(rid, prompt, params)
        first = None
        while e.has_unfinished():
            for o in e.step():
                if o.request_id == rid and o.token_ids and first is None:
                    first = time.perf_counter() - t
        return first


# ---- through Redis and a worker --------------------------------------------------------------
class ThroughWorker:
    def __init__(self, model_dir: Path, redis_url: str, tokenizer, served: str):
        import redis.asyncio as aioredis

        from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
        from llmq.common.transport import AsyncTransport, Keys

        self.client = aioredis.Redis.from_url(redis_url)
        self.transport = AsyncTransport(self.client, Keys("llmq"))
        self.pipeline = TokenGeneratorPipeline(self.transport, tokenizer, served)

    async def run(self, prompts: list[list[int]], params) -> tuple[float, int]:
        t = time.perf_counter()
        results = await asyncio.gather(*(self.pipeline.all_tokens(p, params) for p in prompts))
        secs = time.perf_counter() - t
        return secs, sum(len(r.token_ids) for r in results)

    async def ttft(self, prompt: list[int], params) -> dict:
        """Seconds to the first token, and its parts: ``submit`` (subscribe and enqueue, in
        the client), ``pickup`` (enqueued until the worker marks it running, by the wall
        clocks of the two processes) and ``first`` (from there to the token at the client)."""
        w0, t = time.time(), time.perf_counter()
        stream = await self.pipeline.submit(prompt, params)
        submitted = time.perf_counter() - t
        first = first_wall = None
        try:
            async for chunk in stream:
                if chunk.token_ids and first is None:
                    first, first_wall = time.perf_counter() - t, time.time()
        finally:
            await stream.aclose()
        state, _, _ = await self.transport.request_state(stream.id, stream.request.model)
        started = float(state.get("started") or "nan")
        return {
            "ttft": first,
            "submit": submitted,
            "pickup": started - w0 - submitted,
            "first": first_wall - started,
        }

    async def close(self) -> None:
        await self.transport.close()
        await self.client.aclose()
