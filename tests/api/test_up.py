"""`llmq up`: its worker plan, its embedded Redis, a clean stop, and CPU workers that share one
load of the model (`llmq worker --fork`), a forked one outliving its parent, against real
processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import suppress
from pathlib import Path

import httpx
import openai
import psutil
import redis

from llmq.common.transport.redis_server import free_port
from llmq.tools.up import plan_workers
from tests.api.api_stack import MESSAGES, client
from tests.harness import (
    LLMQ,
    up_env,
    wait_for,
)


# ---- 6. llmq up ------------------------------------------------------------------------------
def test_llmq_up_plans_workers_per_gpu_or_one_on_a_cpu():
    def cpu(threads: int, cores: int) -> dict[str, str]:
        return {"LLMQ_TORCH_THREADS": str(threads), "LLMQ_SMALL_STEP_THREADS": str(cores)}

    assert plan_workers(None, "auto", 2, 0, None) == [cpu(2, 2)]
    assert plan_workers(None, "cpu", 16, 4, None) == [cpu(16, 16)]
    assert plan_workers(None, "auto", 1, 0, None) == [cpu(1, 1)]
    assert plan_workers(2, "cpu", 2, 0, None) == [cpu(1, 2)] * 2
    assert plan_workers(3, "cpu", 8, 0, 4) == [cpu(4, 8)] * 3
    assert plan_workers(None, "auto", 16, 2, None) == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]


def assert_embedded_redis_is_locked(state_dir: Path, cmdlines: str, log: str) -> None:
    """`llmq up`'s Redis password is in its state file and in no command line (`ps`) or log
    (how that Redis refuses clients without it: tests/faults/test_unauthenticated_redis.py);
    it keeps an AOF, written before each answer and fsynced once a second."""
    state_file = state_dir / f"llmq-up-{os.getuid()}.json"
    assert state_file.stat().st_mode & 0o777 == 0o600
    url = json.loads(state_file.read_text())["redis_url"]
    password = redis.connection.parse_url(url)["password"]
    assert len(password) >= 24 and password not in cmdlines and password not in log
    embedded = redis.Redis.from_url(url, decode_responses=True)
    assert embedded.ping()
    persistence = embedded.config_get("append*")
    assert (persistence["appendonly"], persistence["appendfsync"]) == ("yes", "everysec")


def start_up(llama_dir, tmp_path: Path, **settings) -> tuple[subprocess.Popen, int, Path]:
    """`llmq up` with two workers (on a CPU: one, and one forked from it after the load), in
    its own session as a shell job: SIGINT to its group is what Ctrl-C sends. Its state file
    goes to tmp_path."""
    port = free_port()
    env = up_env(llama_dir, port, tmp_path, workers=2, **settings)
    assert "LLMQ_REDIS_URL" not in env
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        up = subprocess.Popen(
            [LLMQ, "up"], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return up, port, log


def assert_answers_within_a_minute(up, port: int, log: Path, llama_dir, tmp_path: Path):
    """A chat answer within a minute of the start; the embedded Redis and two workers among
    its children, the API without torch, both engines ready. Returns the children."""
    started = time.monotonic()
    c = client(f"http://127.0.0.1:{port}", timeout=10)

    def answered():
        if up.poll() is not None:
            raise RuntimeError(f"llmq up exited:\n{log.read_text()[-4000:]}")
        try:
            return c.chat.completions.create(
                model=str(llama_dir), messages=MESSAGES, max_tokens=8, temperature=0
            )
        except (openai.APIConnectionError, openai.APIStatusError):
            return None

    resp = wait_for(answered, 60, "a chat answer from llmq up", 0.5)
    assert time.monotonic() - started < 60
    assert resp.choices[0].message.content is not None
    assert resp.usage.completion_tokens >= 1
    children = psutil.Process(up.pid).children(recursive=True)
    names = " ".join(" ".join(p.cmdline()) for p in children)
    assert "redis-server" in names, names
    workers = [p for p in children if "worker" in p.cmdline()]
    assert len(workers) == 2, names
    assert_embedded_redis_is_locked(tmp_path, names, log.read_text())
    # The API process needs no torch (about 0.2 GiB resident had it imported it).
    api_maps = {m.path for m in psutil.Process(up.pid).memory_maps()}
    assert not [m for m in api_maps if "libtorch" in m], "the API process imported torch"
    # Both serve: /ready counts their live heartbeats.
    ready = wait_for(
        lambda: (r := httpx.get(f"http://127.0.0.1:{port}/ready")).json().get("engines") == 2 and r,
        60,
        "two engines ready",
    )
    assert ready.status_code == 200
    return children


def kill_up(up: subprocess.Popen, children: list[psutil.Process]) -> None:
    """What a failed test leaves: `llmq up` and its children (the worker has its own session,
    so the group kill misses it)."""
    with suppress(psutil.Error):
        children = children or psutil.Process(up.pid).children(recursive=True)
    os.killpg(up.pid, signal.SIGKILL)
    up.wait()
    for child in children:
        with suppress(psutil.Error):
            child.kill()


def assert_stopped_cleanly(log: Path, children: list[psutil.Process]) -> None:
    """Its last words, and nothing of it left running (the API, the workers, the Redis)."""
    assert "llmq: stopped" in log.read_text()
    _, alive = psutil.wait_procs(children, timeout=5)
    left = [p.cmdline() for p in alive]
    for p in alive:
        p.kill()
    assert not alive, f"left running: {left}"


def test_llmq_up_answers_within_a_minute_and_stops_cleanly_on_sigterm(llama_dir, tmp_path):
    """SIGTERM to the process alone (docker stop, systemd, kill) stops the API, both workers
    and the embedded Redis. Ctrl-C: test_forked_workers_share_the_model_and_outlive_their_parent
    (the same start, stopped by SIGINT to the group)."""
    up, port, log = start_up(llama_dir, tmp_path)
    started = time.monotonic()
    children: list[psutil.Process] = []
    try:
        children = assert_answers_within_a_minute(up, port, log, llama_dir, tmp_path)
        up.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        rc = up.wait(30)
        stopped_in = time.monotonic() - stopping
    finally:
        if up.poll() is None:  # the test failed: leave nothing behind
            kill_up(up, children)
    assert rc == 128 + signal.SIGTERM, log.read_text()[-4000:]
    assert_stopped_cleanly(log, children)
    print(f"llmq up: answered after {stopping - started:.1f}s, stopped in {stopped_in:.1f}s")


# ---- forked workers --------------------------------------------------------------------------
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
    """The second worker is forked from the first after its load and outlives it; Ctrl-C
    (SIGINT to the terminal's process group) then stops `llmq up`, the orphan and the Redis."""
    # A short heartbeat TTL: the killed parent's heartbeat is gone (one engine ready) sooner.
    up, port, log = start_up(llama_dir, tmp_path, heartbeat_ttl=2)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=30)
    children: list[psutil.Process] = []
    try:
        children = assert_answers_within_a_minute(up, port, log, llama_dir, tmp_path)
        workers = [p for p in children if "worker" in p.cmdline()]
        parent = next(p for p in workers if p.ppid() == up.pid)
        child = next(p for p in workers if p.ppid() == parent.pid)
        assert "--fork" in parent.cmdline()
        # torch, the tokenizer and the weights were loaded once, before the fork.
        assert _shared_dirty_kib(child) > 50 * 1024, _shared_dirty_kib(child)

        parent.kill()  # a crash: no warm shutdown, nothing handed back
        wait_for(lambda: _gone(parent), 10, "the parent worker dead")
        # Adopted by `llmq up` once the last of the parent's threads has exited.
        wait_for(lambda: child.ppid() == up.pid, 10, "the forked worker adopted by llmq up")
        assert child.is_running()
        wait_for(lambda: _engines(port) == 1, 60, "the forked worker alone", 0.5)
        resp = c.chat.completions.create(
            model=str(llama_dir), messages=MESSAGES, max_tokens=8, temperature=0
        )
        assert resp.usage.completion_tokens >= 1

        os.killpg(up.pid, signal.SIGINT)  # Ctrl-C
        rc = up.wait(60)
    finally:
        if up.poll() is None:
            kill_up(up, children)
    assert rc == 0, log.read_text()[-4000:]
    # `llmq up` waited for the orphan (its child now) before exiting, and left nothing.
    assert not child.is_running(), "the orphaned worker was left running"
    assert_stopped_cleanly(log, children)
