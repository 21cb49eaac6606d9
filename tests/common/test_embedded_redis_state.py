"""The state file through which `llmq up` tells the other llmq commands where its Redis is (and
its password): written for this user alone, and read only when this user owns it."""

from __future__ import annotations

import json
import os

import pytest

from llmq.common.settings import _embedded_redis_file, embedded_redis_url, publish_embedded_redis

pytestmark = pytest.mark.unit

URL = "redis://:secret@127.0.0.1:6390/0"


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_written_for_this_user_alone_and_read_back(state_dir):
    path = publish_embedded_redis(URL)
    assert path == _embedded_redis_file() and path.parent == state_dir
    assert path.stat().st_mode & 0o777 == 0o600
    assert embedded_redis_url() == URL
    publish_embedded_redis(None)
    assert not path.exists() and embedded_redis_url() is None


def test_a_file_others_can_read_or_write_or_another_user_owns_is_ignored(state_dir):
    path = publish_embedded_redis(URL)
    path.chmod(0o644)
    assert embedded_redis_url() is None
    path.chmod(0o600)
    assert embedded_redis_url() == URL
    if os.getuid() != 0:
        pytest.skip("changing a file's owner needs root")
    os.chown(path, 65534, 65534)
    assert embedded_redis_url() is None


def test_a_stopping_llmq_up_leaves_another_ones_file(state_dir):
    """Two `llmq up` on one machine: the first to stop does not remove the second's file."""
    path = _embedded_redis_file()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"redis_url": URL, "pid": os.getppid()}))
    publish_embedded_redis(None)
    assert path.exists() and embedded_redis_url() == URL
