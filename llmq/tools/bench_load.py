"""The load of `llmq bench`: one streamed request timed chunk by chunk, and the closed-loop
(``concurrency`` requests in flight) or open-loop (Poisson arrivals at ``rate``) run of many."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


@dataclass
class RequestResult:
    ok: bool = False
    start: float = 0.0  # seconds from the run's start
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served
    chunks: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class RequestShape:
    """What every request of a run asks for; ``body`` is one request's JSON."""

    model: str
    endpoint: str  # "chat" or "completions"
    temperature: float
    images: int = 0  # images in each chat request, after the prompt (each request its own)
    image_size: tuple[int, int] = (640, 480)
    speculative: bool = True  # False: each request opts out of speculative decoding (llmq's)

    @property
    def path(self) -> str:
        return "/chat/completions" if self.endpoint == "chat" else "/completions"

    def body(self, prompt: str | list[dict], max_tokens: int, extras: bool) -> dict:
        """Streamed, with usage; ``extras`` asks for exactly ``max_tokens`` (min_tokens and
        ignore_eos, which not every server takes). A list is a chat's messages, sent as they
        are."""
        b: dict = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if isinstance(prompt, list):
            b["messages"] = prompt
        elif self.endpoint == "chat":
            content = [{"type": "text", "text": prompt}, *self.image_parts(prompt)]
            b["messages"] = [{"role": "user", "content": content if self.images else prompt}]
        else:
            b["prompt"] = prompt
        if extras:
            b["min_tokens"] = max_tokens
            b["ignore_eos"] = True
        if not self.speculative:
            b["speculative"] = False
        return b

    def image_parts(self, prompt: str) -> list[dict]:
        """``images`` PNGs of random pixels as data URLs, drawn from the prompt's hash: each
        request's own (no server reuses one), the same in every run."""
        seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
        return [
            {"type": "image_url", "image_url": {"url": random_png(seed + i, self.image_size)}}
            for i in range(self.images)
        ]


def random_png(seed: int, size: tuple[int, int]) -> str:
    """A data URL of a PNG of random pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


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
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens", res.cached_tokens)
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
