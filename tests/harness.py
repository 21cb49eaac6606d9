"""Real processes for integration tests: redis-server, `llmq worker`, `llmq api`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from llmq.common.transport import Keys
from llmq.common.transport.redis_clients import tool_client
from llmq.common.transport.redis_cluster import is_cluster_url

LLMQ = str(Path(sys.executable).parent / "llmq")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class Proc:
    """A child process with its log in a file, shown when something fails."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            args, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self, tail: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-tail:]

    def kill(self) -> None:
        """SIGKILL the whole process group: nothing gets to clean up."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode


def kill_all(procs) -> None:
    """Cleanup once a test is done with its processes: SIGKILL to each one's process group,
    then its log closed. Nothing of their stop is checked here, and a worker's warm stop takes
    a second or two (Celery's loop notices SIGTERM at its next poll); the tests of warm stops
    stop their processes themselves (``Proc.terminate``)."""
    for proc in procs:
        if proc is not None:
            proc.kill()
            proc.terminate()  # closes its log


def base_env(redis_url: str, model: str | Path, **settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        LLMQ_REDIS_URL=redis_url,
        LLMQ_MODEL=str(model),
        LLMQ_DTYPE="float32",
        LLMQ_DEVICE="cpu",
        LLMQ_TORCH_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update({f"LLMQ_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def up_env(model: str | Path, port: int, state_dir: Path, **settings) -> dict[str, str]:
    """The environment of an `llmq up` with its own embedded Redis (no LLMQ_ setting of the
    caller's), leaving its state file in ``state_dir``, not the user's runtime dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env.update(
        LLMQ_MODEL=str(model),
        LLMQ_PORT=str(port),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        XDG_RUNTIME_DIR=str(state_dir),
    )
    env.update({f"LLMQ_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def start_worker(
    redis_url: str, model: str | Path, name: str, log_dir: Path, wait: bool = True, **settings
) -> Proc:
    env = base_env(redis_url, model, **settings)
    proc = Proc([LLMQ, "worker", "--name", name], env, log_dir / f"worker-{name}.log")
    if wait:
        wait_worker(redis_url, name, proc, settings.get("key_prefix", "llmq"))
    return proc


def start_workers(
    redis_url: str, model: str | Path, names, log_dir: Path, **settings
) -> dict[str, Proc]:
    """Workers of one model started side by side (each loads while the others do); returned
    once every one is up, or all killed if one is not."""
    procs = {n: start_worker(redis_url, model, n, log_dir, wait=False, **settings) for n in names}
    try:
        for name, proc in procs.items():
            wait_worker(redis_url, name, proc, settings.get("key_prefix", "llmq"))
    except BaseException:
        for proc in procs.values():
            proc.kill()
        raise
    return procs


def engine_key(redis_url: str, name: str, prefix: str = "llmq") -> str:
    """The key of a worker's heartbeat (hash-tagged on a Redis Cluster)."""
    return Keys(prefix, cluster=is_cluster_url(redis_url)).engine(name)


def wait_worker(redis_url: str, name: str, proc: Proc, prefix: str = "llmq", timeout=90.0) -> None:
    client = tool_client(redis_url)  # a sentinel:// or redis+cluster:// URL too
    key = engine_key(redis_url, name, prefix)

    def ready():
        if not proc.alive():
            raise RuntimeError(f"worker {name} exited:\n{proc.log()}")
        return client.exists(key)

    wait_for(ready, timeout, f"worker {name}", 0.05)  # an EXISTS: next to no CPU


def heartbeat(redis_url: str, name: str, prefix: str = "llmq") -> dict[str, str]:
    raw = tool_client(redis_url).hgetall(engine_key(redis_url, name, prefix))
    return {k.decode(): v.decode() for k, v in raw.items()}


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def llmq_inspect(redis_url: str) -> str:
    """What `llmq inspect` prints of the deployment at ``redis_url``."""
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url}
    return subprocess.run(
        [LLMQ, "inspect"], env=env, text=True, capture_output=True, check=True
    ).stdout


def start_api(
    redis_url: str, model: str | Path, log_dir: Path, name: str = "api", **settings
) -> tuple[Proc, str]:
    """Run `llmq api` (a real uvicorn server) on a free port; returns it and its base URL once
    /health answers."""
    import httpx

    from llmq.common.transport.redis_server import free_port

    port = free_port()
    env = base_env(redis_url, model, **settings)
    proc = Proc([LLMQ, "api", "--port", str(port)], env, log_dir / f"{name}.log")
    base = f"http://127.0.0.1:{port}"

    # One client for the whole wait: a bare httpx.get builds an SSL context each call, ~20 ms
    # of CPU, which taken 10 times a second competed with the API's own start.
    with httpx.Client(timeout=1) as client:

        def healthy():
            if not proc.alive():
                raise RuntimeError(f"api {name} exited:\n{proc.log()}")
            try:
                return client.get(f"{base}/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 60, f"api {name}", 0.05)
    return proc, base


def recorded_tokens(client, request_id: str, prefix: str = "llmq") -> list[int]:
    """The tokens a request's record holds as a reader sees them: its list's values, then what
    its owner's log holds past them (the API's own read)."""
    from llmq.common.transport.output_log import merge
    from llmq.common.transport.scripts import READ_SCRIPT

    keys = Keys(prefix)
    read = client.register_script(READ_SCRIPT)
    _, listed, logged = read(
        keys=[keys.req(request_id), keys.tokens(request_id)],
        args=[keys.log_prefix, request_id, keys.out(request_id)],
    )
    return merge([v.decode() if isinstance(v, bytes) else v for v in listed + logged])[0]


def request_ids(client, prefix: str = "llmq") -> list[str]:
    """The ids of the requests whose records Redis holds."""
    head = f"{prefix}:req:"
    names = (k.decode() for k in client.scan_iter(match=f"{head}*"))
    return [n[len(head) :] for n in names if not n.endswith(":tokens")]
