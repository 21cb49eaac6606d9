"""`llmq up`'s CPU workers share one load of the model (`llmq worker --fork`), and a forked
worker whose parent dies keeps serving and is still stopped with the rest."""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import suppress

import httpx
import openai
import psutil

from llmq.common.redis_server import free_port
from tests.harness import LLMQ, up_env, wait_for

MESSAGES = [{"role": "user", "content": "What does XREADGROUP do?"}]


def _engines(port: int) -> int | None:
    with suppress(httpx.HTTPError):
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).json().get("engines")
    return None


def _gone(proc: psutil.Process) -> bool:
    """Exited: `llmq up` reaps its worker only when it stops, so until then a zombie."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _shared_dirty_kib(proc: psutil.Process) -> int:
    """Private anonymous memory is never shared between unrelated processes: pages shared and
    written to (dirty) come from a fork."""
    with open(f"/proc/{proc.pid}/smaps_rollup") as rollup:
        return next(int(line.split()[1]) for line in rollup if line.startswith("Shared_Dirty:"))


def test_forked_workers_share_the_model_and_outlive_their_parent(llama_dir, tmp_path):
    port = free_port()
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        up = subprocess.Popen(
            [LLMQ, "up"], env=up_env(llama_dir, port, tmp_path, workers=2), cwd=tmp_path,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=30)
    workers: list[psutil.Process] = []
    try:
        wait_for(lambda: _engines(port) == 2, 90, "two engines ready", 0.5)
        workers = [p for p in psutil.Process(up.pid).children(recursive=True)
                   if "worker" in p.cmdline()]  # fmt: skip
        parent = next(p for p in workers if p.ppid() == up.pid)
        child = next(p for p in workers if p.ppid() == parent.pid)
        assert "--fork" in parent.cmdline()
        # torch, the tokenizer and the weights were loaded once, before the fork.
        assert _shared_dirty_kib(child) > 50 * 1024, _shared_dirty_kib(child)

        parent.kill()  # a crash: no warm shutdown, nothing handed back
        wait_for(lambda: _gone(parent), 10, "the parent worker dead")
        assert child.is_running() and child.ppid() == up.pid  # adopted by `llmq up`
        wait_for(lambda: _engines(port) == 1, 60, "the forked worker alone", 0.5)
        resp = c.chat.completions.create(
            model=str(llama_dir), messages=MESSAGES, max_tokens=8, temperature=0
        )
        assert resp.usage.completion_tokens >= 1

        os.killpg(up.pid, signal.SIGINT)  # Ctrl-C
        rc = up.wait(60)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        for w in workers:
            with suppress(psutil.Error):
                w.kill()
    assert rc == 0, log.read_text()[-4000:]
    # `llmq up` waited for it (its parent now) before exiting.
    assert not child.is_running(), "the orphaned worker was left running"
