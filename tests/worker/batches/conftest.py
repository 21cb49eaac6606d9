"""The stack (Redis, worker, API) each batch test module shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.batches.batch_stack import WORKERS, stack


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batch-logs")


@pytest.fixture(scope="module")
def main(llama_dir, logs):
    """The Redis, worker and API shared by the tests of this module."""
    with stack(llama_dir, logs, "wb-main") as s:
        WORKERS.append(s.worker)
        yield s
