"""Redis Cluster addresses: ``redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]``
(any of the cluster's nodes; the clients learn the rest from them). Celery's broker cannot be
a cluster (kombu has no cluster transport): with a cluster URL, LLMQ_CELERY_BROKER_URL names
the one Redis node (or sentinel set) Celery uses."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

SCHEME = "redis+cluster"
DEFAULT_PORT = 6379


@dataclass(frozen=True)
class ClusterAddress:
    nodes: list[tuple[str, int]]
    password: str | None = None
    username: str | None = None

    def kwargs(self) -> dict:
        kwargs: dict = {}
        if self.password is not None:
            kwargs["password"] = self.password
        if self.username is not None:
            kwargs["username"] = self.username
        return kwargs


def is_cluster_url(url: str | None) -> bool:
    return bool(url) and url.startswith(f"{SCHEME}://")


def parse_cluster_url(url: str) -> ClusterAddress:
    """The startup nodes of a ``redis+cluster://`` URL; ValueError on anything else."""
    split = urlsplit(url)
    if split.scheme != SCHEME:
        raise ValueError(f"not a {SCHEME}:// URL")
    hosts = split.netloc.rpartition("@")[2]
    nodes = []
    for part in filter(None, (p.strip() for p in hosts.split(","))):
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        if not host or (port and not port.isdigit()):
            raise ValueError(f"not a HOST:PORT node in a {SCHEME}:// URL: {part!r}")
        nodes.append((host, int(port) if port else DEFAULT_PORT))
    if not nodes:
        raise ValueError(f"a {SCHEME}:// URL names at least one node")
    userinfo = split.netloc.rpartition("@")[0] if "@" in split.netloc else ""
    user, _, password = userinfo.partition(":")
    return ClusterAddress(
        nodes,
        password=unquote(password) if password else None,
        username=unquote(user) if user else None,
    )
