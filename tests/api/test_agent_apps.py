"""Claude Code and the Codex CLI, as npm installs them (the versions pinned in
tests/agent_apps/package.json, installed under .venv/agent-apps by ``npm ci`` on first use),
against real processes: Redis, an `llmq worker` of a random model built with a 131,072-token
context (``make_model(context=...)``, as `llmq make-model --context`: the apps' first prompts
run to 23k tokens of its small vocabulary) and `llmq api`. Each CLI runs in print mode with its
defaults, no flag of its own: pointed at llmq by its documented settings (Claude Code's
ANTHROPIC_BASE_URL, ANTHROPIC_MODEL; Codex's model provider in ~/.codex/config.toml), HOME a
fresh folder, every other destination unreachable: a network namespace whose one link leads
to the proxy's address (where none can be made, without root, the apps run on the host's
network, Claude Code with CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC, as it runs in the
namespace too).

The random model's free text is noise of any length, so a loopback proxy (agent_proxy.py)
steers it: the turn whose prompt asks for notes.txt is forced to call the app's own tool
(``tool_choice``; the argument pinned by an ``enum`` in that tool's schema, so the grammar
writes the exact call), and every other turn gets a JSON schema whose one value is ANSWER.
So each run is: the prompt, the forced call, the app runs its tool and sends the result back,
and the answer. The proxy leaves every other field as the app sent it.

Checked: exit 0 with the answer; the tool's result sent back as the answer to the call; a
continued conversation (``claude -c -p``, ``codex exec resume --last``) carries the earlier
turns; Claude Code's usage on the continued request reports as cached the prompt tokens the
worker's prefix cache served (its heartbeat's count); no 4xx or 5xx in llmq's access log over
the runs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

from llmq.tools.model_factory import make_model
from tests import netns
from tests.api.agent_proxy import ANSWER, AgentProxy, Exchange, Steering
from tests.api.api_stack import stack
from tests.harness import wait_for

ROOT = Path(__file__).resolve().parents[2]
APPS_SOURCE = ROOT / "tests" / "agent_apps"
APPS = ROOT / ".venv" / "agent-apps"
KEY = "sk-agent-apps"
CONTEXT = 131_072
SECRET = "the tide turns at 06:40"
RUN_TIMEOUT = 300
CACHE_FIELDS = ("cache_read_input_tokens", "cache_creation_input_tokens")
ACCESS = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')


def _versions(package: str) -> dict[str, str]:
    """The pinned versions of an npm package, each with its folder under node_modules (an
    alias, ``npm:<package>@<version>``, installs a second version beside the first)."""
    deps = json.loads((APPS_SOURCE / "package.json").read_text())["dependencies"]
    found = {}
    for name, spec in deps.items():
        if name == package:
            found[spec] = name
        elif spec.startswith(f"npm:{package}@"):
            found[spec.rsplit("@", 1)[1]] = name
    return found


CLAUDE = _versions("@anthropic-ai/claude-code")
CODEX = _versions("@openai/codex")


# ---- the apps, the stack, the network ------------------------------------------------------
@pytest.fixture(scope="module")
def apps() -> Path:
    """node_modules of the pinned apps, installed once (again when the lock file changes)."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed")
    lock = (APPS_SOURCE / "package-lock.json").read_text()
    installed = APPS / "package-lock.json"
    if not (
        installed.exists() and installed.read_text() == lock and (APPS / "node_modules").exists()
    ):
        APPS.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(APPS_SOURCE / name, APPS / name)
        cmd = ["npm", "ci", "--prefix", str(APPS), "--no-audit", "--no-fund"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    return APPS / "node_modules"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_model(tmp_path_factory.mktemp("agent-model") / "llama", context=CONTEXT)
    logs = tmp_path_factory.mktemp("agent-logs")
    with stack(model, logs, "w-agents", {}, {"api_key": KEY}) as s:
        yield s


@contextlib.contextmanager
def _namespace():
    """A network namespace whose one link leads to an address of this host: (its command
    prefix, the host's address on the link); (None, 127.0.0.1) where none can be made."""
    if netns.available() is not None:
        yield None, "127.0.0.1"
        return
    tag = uuid.uuid4().hex[:6]
    ns, outside, inside = f"llmqapps{tag}", f"va{tag}o", f"va{tag}i"
    subnet = 64 + int(tag, 16) % 180  # apart from another run's (and tests/netns' 10.213.7)
    host, guest = f"10.213.{subnet}.1", f"10.213.{subnet}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        ip("netns", "add", ns)
        ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        ip("link", "set", inside, "netns", ns)
        ip("addr", "add", f"{host}/30", "dev", outside)
        ip("link", "set", outside, "up")
        ip("-n", ns, "addr", "add", f"{guest}/30", "dev", inside)
        ip("-n", ns, "link", "set", inside, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        yield ["ip", "netns", "exec", ns], host
    finally:
        subprocess.run(["ip", "link", "del", outside], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def network():
    with _namespace() as found:
        yield found


@pytest.fixture(scope="module")
def proxy(served, network):
    with AgentProxy(served.base, network[1]) as p:
        yield p


# ---- running an app ------------------------------------------------------------------------
class Run:
    def __init__(self, proc: subprocess.CompletedProcess, exchanges: list[Exchange], log: str):
        self.proc = proc
        self.exchanges = exchanges
        self.errors = [m.groups() for m in ACCESS.finditer(log) if int(m.group(3)) >= 400]

    def check(self) -> None:
        """Exit 0 with the answer, and no 4xx or 5xx in llmq's access log meanwhile."""
        assert self.proc.returncode == 0, self.proc.stdout + self.proc.stderr
        assert ANSWER in self.proc.stdout, self.proc.stdout + self.proc.stderr
        assert self.errors == [], self.errors

    def __repr__(self) -> str:  # in a failed assertion: what passed, how long it took
        return repr([(e.method, e.path, e.status, round(e.seconds, 1)) for e in self.exchanges])

    def posts(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path == path]


def _access_log(served) -> Path:
    return served.logs / f"api-{served.worker_name}-main.log"


def run_app(cmd: list[str], env: dict[str, str], cwd: Path, proxy, served, network) -> Run:
    prefix = network[0] or []
    base = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "TERM": "dumb"}
    log, start = _access_log(served), len(proxy.exchanges)
    seen = log.stat().st_size
    proc = subprocess.run(
        [*prefix, *cmd],
        env={**base, **env},
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    with log.open() as f:
        f.seek(seen)
        added = f.read()
    return Run(proc, proxy.since(start), added)


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text(SECRET + "\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    return project


# ---- Claude Code ---------------------------------------------------------------------------
def _usage(exchange: Exchange) -> dict[str, int]:
    """A streamed message's final usage (its message_delta's)."""
    deltas = [e for e in exchange.events() if e.get("type") == "message_delta"]
    assert deltas, exchange.text[:2000]
    return deltas[-1]["usage"]


def _prompt_tokens(exchange: Exchange) -> int:
    """The prompt tokens a generation's answer counts (0: no generation)."""
    if exchange.status != 200 or exchange.path not in ("/v1/messages", "/v1/responses"):
        return 0
    if exchange.path == "/v1/messages":
        usage = _usage(exchange)
        return sum(usage[k] for k in ("input_tokens", *CACHE_FIELDS))
    done = [e for e in exchange.events() if e.get("type") == "response.completed"]
    return done[-1]["response"]["usage"]["input_tokens"]


def _cache_counts(served, proxy) -> tuple[int, int]:
    """The worker's prompt tokens served from its prefix cache and computed, once its
    heartbeat has counted every prompt that passed the proxy."""
    total = sum(_prompt_tokens(e) for e in proxy.exchanges)

    def counted() -> tuple[int, int] | None:
        hb = served.heartbeat()
        cached, computed = int(hb["prompt_tokens_cached"]), int(hb["prompt_tokens_computed"])
        return (cached, computed) if cached + computed == total else None

    return wait_for(counted, 30, f"the worker's count of {total} prompt tokens")


@pytest.mark.parametrize("version", sorted(CLAUDE))
def test_claude_code(version, apps, served, proxy, network, tmp_path):
    project = _project(tmp_path)
    notes = str(project / "notes.txt")
    proxy.steering = Steering("notes.txt", "Read", "file_path", notes)
    claude = [str(apps / CLAUDE[version] / "bin" / "claude.exe")]
    env = {
        "HOME": str(tmp_path / "home"),
        "ANTHROPIC_BASE_URL": proxy.base,
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_MODEL": served.model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    asked = run_app(
        [*claude, "-p", "What does notes.txt say?"], env, project, proxy, served, network
    )
    asked.check()
    call, result = asked.posts("/v1/messages")[:2]
    [use] = [b for b in call.events() if b.get("type") == "content_block_start"]
    assert use["content_block"]["name"] == "Read"
    sent = result.body["messages"][-1]["content"]
    [answer] = [b for b in sent if b.get("type") == "tool_result"]
    assert answer["tool_use_id"] == use["content_block"]["id"]
    assert SECRET in json.dumps(answer["content"])  # Claude Code read the file

    cached, _ = _cache_counts(served, proxy)
    again = run_app([*claude, "-c", "-p", "Thanks."], env, project, proxy, served, network)
    again.check()
    [turn] = again.posts("/v1/messages")
    assert "What does notes.txt say?" in json.dumps(turn.body["messages"])
    usage = _usage(turn)
    read = usage["cache_read_input_tokens"]
    assert read > 0  # the first run's prompt, read from the prefix cache
    assert _cache_counts(served, proxy)[0] - cached == read
    assert usage["cache_creation_input_tokens"] > 0  # its breakpoints: the new turn written


# ---- Codex ---------------------------------------------------------------------------------
def _codex_home(home: Path, model: str, base: str) -> None:
    config = home / ".codex" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(
        f'model = "{model}"\nmodel_provider = "llmq"\n\n[model_providers.llmq]\n'
        f'name = "llmq"\nbase_url = "{base}/v1"\nenv_key = "LLMQ_API_KEY"\n'
        'wire_api = "responses"\n'
    )


@pytest.mark.parametrize("version", sorted(CODEX))
def test_codex(version, apps, served, proxy, network, tmp_path):
    project = _project(tmp_path)
    proxy.steering = Steering("notes.txt", "exec_command", "cmd", "cat notes.txt")
    home = tmp_path / "home"
    _codex_home(home, served.model, proxy.base)
    codex = [str(apps / CODEX[version] / "bin" / "codex.js")]
    env = {"HOME": str(home), "LLMQ_API_KEY": KEY}
    asked = run_app(
        [*codex, "exec", "What does notes.txt say?"], env, project, proxy, served, network
    )
    asked.check()
    call, result = asked.posts("/v1/responses")[:2]
    done = [e for e in call.events() if e.get("type") == "response.output_item.done"]
    [item] = [e["item"] for e in done if e["item"]["type"] == "function_call"]
    assert item["name"] == "exec_command" and json.loads(item["arguments"]) == {
        "cmd": "cat notes.txt"
    }
    outputs = [i for i in result.body["input"] if i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [item["call_id"]]

    again = run_app(
        [*codex, "exec", "resume", "--last", "Thanks."], env, project, proxy, served, network
    )
    again.check()
    [turn] = again.posts("/v1/responses")
    history = json.dumps(turn.body["input"])
    assert "What does notes.txt say?" in history and item["call_id"] in history


def test_the_access_log_check_sees_an_error(served):
    """The check of the runs above fails on a 4xx: a HEAD on a POST-only path is one (405),
    and HEAD / (which Claude Code sends first) is not."""
    log = _access_log(served)
    seen = log.stat().st_size
    headers = {"x-api-key": KEY}
    assert httpx.head(f"{served.base}/", headers=headers).status_code == 200
    assert httpx.head(f"{served.base}/v1/messages", headers=headers).status_code == 405

    def logged() -> str:
        with log.open() as f:
            f.seek(seen)
            text = f.read()
        return text if "/v1/messages" in text else ""

    wait_for(logged, 10, "the access log's lines")
    run = Run(subprocess.CompletedProcess([], 0, ANSWER, ""), [], logged())
    assert run.errors == [("HEAD", "/v1/messages", "405")]
