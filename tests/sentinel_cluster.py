"""A real Redis Sentinel setup for tests: a master, a replica of it and three sentinels
(redis-server processes on loopback ports) that fail over within seconds of the master's death."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from llmq.common.transport.redis_server import RedisServer, free_port, redis_server_binary
from tests.harness import wait_for

MASTER_NAME = "mymaster"


class SentinelCluster:
    """``with SentinelCluster(tmp_path) as c: c.url``; ``c.kill_master()`` starts a failover."""

    def __init__(self, tmp: Path, password: str | None = None):
        self.tmp = tmp
        self.password = password
        self.master = RedisServer(password=password, data_dir=self._dir("master"))
        self.replica: RedisServer | None = None
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen] = []

    def _dir(self, name: str) -> Path:
        path = self.tmp / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return ";".join(f"sentinel://{auth}127.0.0.1:{p}" for p in self.sentinel_ports)

    def start(self) -> SentinelCluster:
        self.master.start()
        args = ["--replicaof", "127.0.0.1", str(self.master.port)]
        if self.password:
            args += ["--masterauth", self.password]
        self.replica = RedisServer(
            password=self.password, data_dir=self._dir("replica"), extra_args=args
        ).start()
        wait_for(lambda: self._link_up(self.replica), 20, "the replica in sync")
        for port in self.sentinel_ports:
            self.sentinels.append(self._start_sentinel(port))
        wait_for(self._sentinels_agree, 20, "the sentinels to see master and replica")
        return self

    def _start_sentinel(self, port: int) -> subprocess.Popen:
        """A sentinel rewrites its conf file (what it learned): each has its own, writable."""
        folder = self._dir(f"sentinel-{port}")
        conf = folder / "sentinel.conf"
        lines = [
            f"port {port}",
            "bind 127.0.0.1",
            f"dir {folder}",
            f"logfile {folder / 'sentinel.log'}",
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master.port} 2",
            f"sentinel down-after-milliseconds {MASTER_NAME} 1000",
            f"sentinel failover-timeout {MASTER_NAME} 3000",
        ]
        if self.password:
            lines.append(f"sentinel auth-pass {MASTER_NAME} {self.password}")
        conf.write_text("\n".join(lines) + "\n")
        return subprocess.Popen(
            [redis_server_binary(), str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _client(self, server: RedisServer) -> redis.Redis:
        return redis.Redis.from_url(server.url, socket_timeout=2, driver_info=None)

    def _link_up(self, server: RedisServer) -> bool:
        return self._client(server).info("replication").get("master_link_status") == "up"

    def _sentinel_view(self, port: int) -> tuple[tuple[str, int], int] | None:
        """The master a sentinel names and how many replicas it knows of."""
        try:
            s = redis.Redis(port=port, socket_timeout=2, driver_info=None, decode_responses=True)
            master = s.sentinel_master(MASTER_NAME)
            return (master["ip"], int(master["port"])), int(master["num-slaves"])
        except redis.RedisError:
            return None

    def _sentinels_agree(self) -> bool:
        want = (("127.0.0.1", self.master.port), 1)
        return all(self._sentinel_view(p) == want for p in self.sentinel_ports)

    def kill_master(self) -> None:
        self.master.stop(kill=True)

    def wait_promoted(self, timeout: float = 30.0) -> None:
        """Until every sentinel names the replica and the replica takes writes as master."""
        assert self.replica is not None
        port = self.replica.port

        def promoted() -> bool:
            views = [self._sentinel_view(p) for p in self.sentinel_ports]
            if not all(v and v[0] == ("127.0.0.1", port) for v in views):
                return False
            return self._client(self.replica).info("replication").get("role") == "master"

        wait_for(promoted, timeout, "the sentinels to promote the replica", 0.1)

    def close(self) -> None:
        for proc in self.sentinels:
            proc.kill()
            proc.wait(10)
        if self.replica is not None:
            self.replica.close()
        self.master.close()

    def __enter__(self) -> SentinelCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
