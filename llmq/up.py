"""`llmq up`: an embedded Redis (unless LLMQ_REDIS_URL is set), one worker and the API in one
command; Ctrl-C stops them all."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from llmq.common.settings import DEFAULT_MODEL, get_settings

log = logging.getLogger("llmq.up")

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
    """The model to serve. The default hub model falls back to a locally built demo model
    (random weights, labelled as such) where the hub cannot be reached."""
    settings = get_settings()
    model = settings.model
    if _hub_reachable(model):
        return model
    if model != DEFAULT_MODEL:
        raise SystemExit(
            f"llmq: cannot load {model!r}: not a local folder and the hub is unreachable"
        )
    if not (DEMO_DIR / "config.json").exists():
        from llmq.common.model_factory import make_model

        make_model(DEMO_DIR, arch="llama", size="tiny")
    print(
        f"llmq: the Hugging Face hub is unreachable; serving a demo model with RANDOM weights from {DEMO_DIR}",
        flush=True,
    )
    return str(DEMO_DIR)


def run_up(log_level: str = "INFO") -> int:
    from llmq.common.redis_server import RedisServer

    settings = get_settings()
    model = resolve_model()
    os.environ["LLMQ_MODEL"] = model
    redis_server = None
    if not settings.redis_url:
        redis_server = RedisServer(appendonly=True).start()
        os.environ["LLMQ_REDIS_URL"] = redis_server.url
        print(f"llmq: embedded Redis at {redis_server.url}", flush=True)
    get_settings.cache_clear()
    settings = get_settings()

    worker = subprocess.Popen(
        [sys.executable, "-m", "llmq.cli", "--log-level", log_level, "worker"],
        env=dict(os.environ),
        start_new_session=True,  # Ctrl-C reaches us; we stop the worker warm, in order
    )
    print(f"llmq: worker starting (model {model})", flush=True)
    print(
        f"llmq: API on http://{settings.host}:{settings.port}  (Ctrl-C stops everything)",
        flush=True,
    )
    try:
        import uvicorn

        from llmq.api.app import create_app

        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level=log_level.lower(),
            timeout_graceful_shutdown=5,
        )
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(settings.shutdown_grace + 20)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        if redis_server is not None:
            redis_server.close()
        print("llmq: stopped", flush=True)
    return 0
