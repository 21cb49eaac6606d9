"""Where `llmq up` tells this machine's other llmq commands its embedded Redis lives: a state
file only its user reads, in the runtime directory."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _embedded_redis_file() -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / (
        f"llmq-up-{os.getuid()}.json"
    )


def publish_embedded_redis(url: str | None) -> Path:
    """Where `llmq up` tells this machine's other llmq commands its embedded Redis lives, its
    password included, in a file only this user reads (None: it stopped; a file another
    `llmq up` wrote since stays). Returns the file's path."""
    path = _embedded_redis_file()
    if url is None:
        if _read_state(path).get("pid") == os.getpid():
            path.unlink(missing_ok=True)
        return path
    path.unlink(missing_ok=True)  # created anew with mode 0600, never readable in between
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"redis_url": url, "pid": os.getpid()}))
    return path


def _read_state(path: Path) -> dict:
    """The state file, if this user owns it and nobody else can read or write it: another
    user's file could point llmq at a Redis of theirs."""
    try:
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            return {}
        state = json.loads(path.read_text())
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def embedded_redis_url() -> str | None:
    """The URL of a running `llmq up`'s embedded Redis, if there is one."""
    state = _read_state(_embedded_redis_file())
    try:
        os.kill(int(state["pid"]), 0)  # still running?
        return str(state["redis_url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
