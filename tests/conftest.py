"""Shared fixtures: locally built random-weight models (built once per test session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def llmq_bytecode():
    """llmq's modules compiled once for every process the tests start: under
    PYTHONDONTWRITEBYTECODE none writes its bytecode, and each `llmq worker` and `llmq api`
    compiled llmq from source again (~0.2 s of CPU a start). A stale file is compiled anew."""
    import compileall

    import llmq

    compileall.compile_dir(Path(llmq.__file__).parent, quiet=1)


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_test_process():
    """Under pytest-xdist (`make test`: two test processes on 2 cores) each test process
    computes with one torch thread: two processes of two threads spin against each other (a
    sampler test ran 4x slower). The processes the tests start keep their own settings."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> callable:
    """model_dir(arch) -> path of a tiny random model of that architecture, built once."""
    from llmq.tools.model_factory import make_model

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


@pytest.fixture(scope="session")
def gguf_dir(llama_dir, tmp_path_factory) -> Path:
    """A folder holding a GGUF file of a Q4_K_M-like mix (Q4_K, Q5_K, Q6_K, Q8_0 tensors) of a
    random Llama of k-quant widths with the test model's tokenizer (tests/worker/gguf_writer)."""
    from tests.worker.gguf_writer import write_mixed_llama

    source, out = tmp_path_factory.mktemp("gguf-src"), tmp_path_factory.mktemp("gguf")
    return write_mixed_llama(llama_dir, source, out)


@pytest.fixture(scope="session")
def llama_stack(llama_dir, tmp_path_factory):
    """A Redis, a worker of the test model and an API (queue limit 50) shared by every package
    that neither changes their settings nor leaves them changed (tests/api's ``main``): a
    worker's start is most of a small module's time. A long heartbeat TTL: a test that stops
    the worker (SIGSTOP) for a moment lets it go on before it ends."""
    from tests.api.api_stack import stack

    logs = tmp_path_factory.mktemp("main-logs")
    with stack(llama_dir, logs, "w-api", dict(heartbeat_ttl=15), dict(max_queue=50)) as s:
        yield s


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module (``pytest.mark.usefixtures``): two make the tiny
    models' small matmuls 10-20x slower on the 2-core test machines."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
