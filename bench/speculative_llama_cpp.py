"""llama.cpp's server on the workloads of ``bench/speculative.py`` (``--llama-cpp``): one
``llama-server`` per speculation setting on the bf16 GGUF of the same float folder, the same
prompts (their token ids), greedy, the same most output tokens, one stream alone and 16 at once.

A setting is ``none`` or a ``--spec-type`` with its draft settings after semicolons:
``ngram-simple;size-n=3;size-m=8`` runs ``--spec-type ngram-simple --spec-ngram-simple-size-n 3
--spec-ngram-simple-size-m 8`` (a ``draft-`` key is ``--spec-draft-...``). A lone
stream's output tokens/s is the server's own ``timings`` (tokens after the first over the time
after it); 16 streams' is all output tokens over the wall time from the first send to the last
answer, as llmq's side counts them; acceptance is ``draft_n_accepted / draft_n`` of the lone
runs."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from llmq.common.transport.redis_server import free_port

# Where the peer script builds llama.cpp and writes a folder's bf16 GGUF.
BUILD = Path(os.environ.get("PEER_VENVS", Path.home() / ".cache/llmq-peers"))
DEFAULT_BIN = BUILD / "llama-cpp/src/llama.cpp/build/bin"
GGUF_NAME = ".llama-cpp-bf16.gguf"
# Its n-gram types with their defaults, and with short lookups and drafts (n-grams of 3-4
# tokens, at most 8 drafted), nearer what pays on a CPU, where each drafted token is computed.
SETTINGS = [
    "none",
    "ngram-simple",
    "ngram-simple;size-n=3;size-m=8",
    "ngram-mod;n-match=4;n-min=2;n-max=8",
]
SLOTS = 16
SLOT_CTX = 1024


def server_args(setting: str) -> list[str]:
    """The llama-server flags of one speculation setting."""
    kind, *pairs = setting.split(";")
    if kind == "none":
        return []
    args = ["--spec-type", kind]
    for pair in pairs:
        key, value = pair.split("=", 1)
        args += [f"--spec-{key}" if key.startswith("draft-") else f"--spec-{kind}-{key}", value]
    return args


@contextmanager
def llama_server(bin_dir: Path, gguf: Path, setting: str, threads: int, log: Path) -> Iterator[str]:
    """A llama-server of ``setting`` on a free port, its base URL once /health answers."""
    port = free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "-c", str(SLOTS * SLOT_CTX)]
    cmd += ["-np", str(SLOTS), "-t", str(threads), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *server_args(setting)]
    env = os.environ | {"LD_LIBRARY_PATH": str(bin_dir)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(base):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server ({setting}) did not start: see {log}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _complete(base: str, prompt: list[int], tokens: int) -> dict:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "stream": False}
    r = httpx.post(f"{base}/completion", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["timings"]


def measure(
    base: str, loads: dict[str, list[list[int]]], kinds: list[str], tokens: int, streams: int
) -> dict:
    """Per workload: a lone stream's and ``streams`` streams' output tokens/s (0: none), and
    the acceptance."""
    _complete(base, loads["free writing"][0], 8)  # warm
    result = {}
    for name in kinds:
        prompts = loads[name]
        lone = [_complete(base, p, tokens) for p in prompts]
        start, batch = time.perf_counter(), []
        if streams:
            with ThreadPoolExecutor(streams) as pool:
                run = (prompts * streams)[:streams]
                batch = list(pool.map(lambda p: _complete(base, p, tokens), run))
        wall = time.perf_counter() - start
        drafted = sum(t.get("draft_n", 0) for t in lone)
        accepted = sum(t.get("draft_n_accepted", 0) for t in lone)
        result[name] = {
            "prompt_tokens": sum(map(len, prompts)) / len(prompts),
            "lone_tps": sum(t["predicted_n"] - 1 for t in lone)
            / sum(t["predicted_ms"] / 1000 for t in lone),
            "lone_tokens": sum(t["predicted_n"] for t in lone),
            "streams_tps": sum(t["predicted_n"] for t in batch) / wall if batch else None,
            "acceptance": (accepted / drafted if drafted else 0.0, None),
        }
    return result


def run_all(
    bin_dir: Path,
    folder: str,
    settings: list[str],
    threads: int,
    loads: dict,
    kinds: list[str],
    tokens: int,
    streams: int,
) -> dict[str, dict]:
    """Every setting's figures, one server at a time."""
    gguf = Path(folder) / GGUF_NAME
    if not (bin_dir / "llama-server").exists() or not gguf.exists():
        raise SystemExit(
            f"llama.cpp: needs {bin_dir}/llama-server and {gguf} (the peer script "
            "../shared/peers/llama-cpp.sh builds the one and converts the folder to the other)"
        )
    results = {}
    for setting in settings:
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{setting.split(';')[0]}.log"
        with llama_server(bin_dir, gguf, setting, threads, log) as base:
            results[f"llama.cpp {setting}"] = measure(base, loads, kinds, tokens, streams)
        print(f"llama.cpp {setting}: done", flush=True)
    return results
