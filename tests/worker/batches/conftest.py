"""The stack (Redis, worker, API) the batch test modules share: a worker's start is most of
a small module's time. test_batch_tools' last test replaces its worker (killed mid-batch);
the next module goes on with the new one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.batches.batch_stack import LEASE, WORKERS, stack


@pytest.fixture(scope="package")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batch-logs")


@pytest.fixture(scope="package")
def main(llama_dir, logs):
    """The Redis, worker and API shared by the tests of this package."""
    with stack(llama_dir, logs, "wb-main", **LEASE) as s:
        WORKERS.append(s.worker)
        yield s
