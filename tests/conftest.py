"""Shared fixtures: locally built random-weight models (built once per test session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> callable:
    """model_dir(arch) -> path of a tiny random model of that architecture, built once."""
    from llmq.common.model_factory import make_model

    root: Path = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in built:
            built[arch] = make_model(root / arch, arch=arch, size="tiny")
        return built[arch]

    return get


@pytest.fixture(scope="session")
def llama_dir(model_dir) -> Path:
    return model_dir("llama")


@pytest.fixture(scope="session")
def qwen2_dir(model_dir) -> Path:
    return model_dir("qwen2")
