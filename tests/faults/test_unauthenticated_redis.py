"""A local user without `llmq up`'s password gets nothing from its embedded Redis: it refuses
clients without it (NOAUTH) or with a wrong one, listens on loopback only, in protected mode,
and the password is in a state file only this user reads (mode 0600), never in a command line.
A state file others could write, or another user's, is not trusted: it could point llmq at a
Redis of theirs."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import psutil
import pytest
import redis

from llmq.common.transport.embedded_redis import (
    _embedded_redis_file,
    embedded_redis_url,
    publish_embedded_redis,
)
from llmq.tools.up import start_embedded_redis
from tests.harness import LLMQ

URL = "redis://:secret@127.0.0.1:6390/0"


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_llmq_up_redis_refuses_clients_without_its_password(state_dir):
    server, path = start_embedded_redis()
    try:
        assert path.parent == state_dir and path.stat().st_mode & 0o777 == 0o600
        url = embedded_redis_url()
        assert url == server.url
        password = redis.connection.parse_url(url)["password"]
        process = psutil.Process(server.proc.pid)
        assert len(password) >= 24 and password not in " ".join(process.cmdline())
        with socket.create_connection((server.host, server.port), timeout=5) as sock:
            sock.sendall(b"KEYS *\r\n")  # what any local user could type
            assert sock.recv(256).startswith(b"-NOAUTH"), "an unauthenticated client was served"
        for bare in (f"redis://{server.host}:{server.port}/0", url.replace(password, "x" * 24)):
            with pytest.raises(redis.AuthenticationError):
                redis.Redis.from_url(bare).ping()
        config = redis.Redis.from_url(url, decode_responses=True).config_get("*")
        assert config["bind"] == "127.0.0.1" and config["protected-mode"] == "yes"
        listening = [c.laddr.ip for c in process.net_connections("inet") if c.status == "LISTEN"]
        assert listening == ["127.0.0.1"], listening
        # The operator who forgets the password is told so in one line.
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
        bare_url = f"redis://{server.host}:{server.port}/0"
        out = subprocess.run(
            [LLMQ, "inspect", "--redis-url", bare_url], capture_output=True, text=True, env=env
        )
        assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith("llmq inspect: Redis refused the password"), out.stderr
    finally:
        publish_embedded_redis(None)
        server.close()
    assert not path.exists() and embedded_redis_url() is None


@pytest.mark.unit
def test_the_state_file_is_written_for_this_user_alone_and_read_back(state_dir):
    path = publish_embedded_redis(URL)
    assert path == _embedded_redis_file() and path.parent == state_dir
    assert path.stat().st_mode & 0o777 == 0o600
    assert embedded_redis_url() == URL
    publish_embedded_redis(None)
    assert not path.exists() and embedded_redis_url() is None


@pytest.mark.unit
def test_a_state_file_others_can_read_or_write_or_another_user_owns_is_ignored(state_dir):
    path = publish_embedded_redis(URL)
    for mode in (0o644, 0o620, 0o604):
        path.chmod(mode)
        assert embedded_redis_url() is None, oct(mode)
    path.chmod(0o600)
    assert embedded_redis_url() == URL
    if os.getuid() != 0:
        pytest.skip("changing a file's owner needs root")
    os.chown(path, 65534, 65534)
    assert embedded_redis_url() is None


@pytest.mark.unit
def test_a_stopping_llmq_up_leaves_another_ones_state_file(state_dir):
    """Two `llmq up` on one machine: the first to stop does not remove the second's file."""
    path = _embedded_redis_file()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"redis_url": URL, "pid": os.getppid()}))
    publish_embedded_redis(None)
    assert path.exists() and embedded_redis_url() == URL
