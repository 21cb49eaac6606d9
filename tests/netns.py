"""Test hosts in network namespaces: each host its own namespace with one address on a shared
bridge (itself inside a namespace), so processes bound to a host's address talk across a real
network path, and killing a host's processes is killing that host."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid

SUBNET = "10.213.{}.{}"


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"llmqprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        return f"cannot create a network namespace: {exc}"
    _ip("netns", "del", name, check=False)
    return None


class Network:
    """``with Network(["redis", "w1", "w2", "api", "client"]) as net: net.addr("redis")``."""

    def __init__(self, hosts: list[str]):
        tag = uuid.uuid4().hex[:5]
        self.tag = tag
        self.bridge_ns = f"llmq{tag}br"
        self.hosts = {h: (f"llmq{tag}{i}", SUBNET.format(7, i + 1)) for i, h in enumerate(hosts)}
        self._made: list[str] = []

    def __enter__(self) -> Network:
        try:
            _ip("netns", "add", self.bridge_ns)
            self._made.append(self.bridge_ns)
            _ip("link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
            _ip("link", "set", "br0", "up", ns=self.bridge_ns)
            _ip("link", "set", "lo", "up", ns=self.bridge_ns)
            for i, (ns, addr) in enumerate(self.hosts.values()):
                _ip("netns", "add", ns)
                self._made.append(ns)
                inside, outside = f"v{self.tag}h{i}", f"v{self.tag}b{i}"
                _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
                _ip("link", "set", inside, "netns", ns)
                _ip("link", "set", outside, "netns", self.bridge_ns)
                _ip("link", "set", outside, "master", "br0", ns=self.bridge_ns)
                _ip("link", "set", outside, "up", ns=self.bridge_ns)
                _ip("link", "set", inside, "name", "eth0", ns=ns)
                _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for ns in reversed(self._made):
            with contextlib.suppress(Exception):
                # Whatever still runs in a host dies with it.
                pids = subprocess.run(
                    ["ip", "netns", "pids", ns], capture_output=True, text=True
                ).stdout.split()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), 9)
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def addr(self, host: str) -> str:
        return self.hosts[host][1]

    def prefix(self, host: str) -> list[str]:
        """Prepend to a command to run it on ``host``."""
        return ["ip", "netns", "exec", self.hosts[host][0]]

    def kill_host(self, host: str) -> None:
        """SIGKILL every process running on the host."""
        ns = self.hosts[host][0]
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        for pid in pids.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
