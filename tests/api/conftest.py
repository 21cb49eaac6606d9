"""Fixtures of the API tests: stacks (Redis, worker, API) shared by the package's modules, and
the in-process reference engine. A worker's start (its model loaded, its kernels readied) is
the slowest part of most modules: the modules that neither change a worker's settings nor
leave it changed share one, kept until the package's last test."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmq.common.model_files import load_tokenizer
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import eos_token_ids, load_causal_lm
from tests.api.api_stack import Reference, stack
from tests.tool_model import with_tools_template

# The key of the shared tools-model stack's API.
TOOLS_KEY = "sk-tools-test"


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("api-logs")


@pytest.fixture(scope="package")
def main(llama_stack):
    """The session's shared Redis, worker and API (queue limit 50) of the test model: tests
    that stop the worker (SIGSTOP) let it go on before they end; those that need other API
    settings start an API of their own on it (``Stack.api``)."""
    return llama_stack


@pytest.fixture(scope="module")
def small(llama_dir, logs):
    """A second Redis with a worker of a short context (64 tokens): schemathesis' generated
    requests are either refused with 400 or finish fast."""
    with stack(llama_dir, logs, "w-small", dict(max_model_len=64), dict(request_timeout=30)) as s:
        yield s


@pytest.fixture(scope="package")
def tools_stack(llama_dir, tmp_path_factory):
    """A Redis, a worker of the test model with a chat template that renders tools, and an API
    that requires TOOLS_KEY: shared by the API surfaces' modules (Messages, Ollama, Responses,
    tool calls), which neither stop the worker nor change its settings."""
    model = with_tools_template(llama_dir, tmp_path_factory.mktemp("tools-model") / "llama")
    logs = tmp_path_factory.mktemp("tools-logs")
    with stack(model, logs, "w-tools-shared", {}, {"api_key": TOOLS_KEY}) as s:
        yield s


@pytest.fixture(scope="package")
def ref(llama_dir) -> Reference:
    """The in-process engine in float32, as the worker runs in tests."""
    tok = load_tokenizer(str(llama_dir))
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    return Reference(tok, LLMEngine(model, EngineConfig(num_blocks=512), eos_token_ids(model, tok)))
