"""A real Redis Cluster for tests: three masters (redis-server processes with cluster mode on,
on loopback ports) joined by `redis-cli --cluster create`, every slot covered."""

from __future__ import annotations

import random
import socket
import subprocess
from pathlib import Path

import redis

from llmq.common.transport.redis_server import RedisServer, redis_cli_binary
from tests.harness import wait_for


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher) is free too; Redis refuses a cluster
    node on a port above 55535."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterNodes:
    """``with RedisClusterNodes(tmp_path) as c: c.url`` (a ``redis+cluster://`` URL)."""

    def __init__(self, tmp: Path, masters: int = 3):
        self.nodes = [
            RedisServer(
                port=cluster_port(),
                data_dir=self._dir(tmp / f"node-{i}"),
                extra_args=["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"],
            )
            for i in range(masters)
        ]

    @staticmethod
    def _dir(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisClusterNodes:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        cli = redis_cli_binary()
        assert cli, "redis-cli is needed (Debian's redis-tools)"
        cmd = [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        wait_for(self._ok, 30, "the cluster's state ok on every node")
        return self

    def _ok(self) -> bool:
        for node in self.nodes:
            info = redis.Redis(port=node.port, decode_responses=True).cluster("info")
            if info.get("cluster_state") != "ok":
                return False
        return True

    def client(self) -> redis.cluster.RedisCluster:
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(kill=True)

    def __enter__(self) -> RedisClusterNodes:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
