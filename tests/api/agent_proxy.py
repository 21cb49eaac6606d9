"""A loopback proxy between an agent CLI and llmq that records every exchange and steers the
random test model: the turn that asks for the tool is forced to call it (``tool_choice``; its
argument is pinned by an ``enum`` in the tool's schema, on every turn so that the prompts of
a conversation share their prefix, so the grammar writes exactly the call the test expects),
and every other turn is given a JSON schema whose one value is ANSWER (the grammar writes it
and then the end of the message), so that each answer is short and known. Everything else
reaches llmq as the CLI sent it."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.harness import wait_for

ANSWER = "llmq answered"
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": [ANSWER]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def pinned(name: str, value: str) -> dict[str, Any]:
    """A tool schema whose one argument ``name`` can only be ``value``."""
    return {
        "type": "object",
        "properties": {name: {"type": "string", "enum": [value]}},
        "required": [name],
        "additionalProperties": False,
    }


@dataclass
class Exchange:
    method: str
    path: str
    body: dict[str, Any] | None  # as the CLI sent it
    sent: dict[str, Any] | None  # as llmq got it
    status: int
    text: str
    seconds: float  # from the request's arrival to llmq's whole answer

    def events(self) -> list[dict[str, Any]]:
        """The JSON data of the answer's SSE events."""
        return [
            json.loads(line[5:])
            for line in self.text.splitlines()
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")
        ]


@dataclass
class Steering:
    """Which turn is made to call which tool, with which argument."""

    marker: str  # text in the user's prompt that asks for the tool
    tool: str
    argument: str
    value: str


def _last_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if isinstance(b, dict))


def steer_messages(body: dict[str, Any], steering: Steering) -> dict[str, Any]:
    """A Messages request: the prompt's turn forced to call the tool, any other answered."""
    body = json.loads(json.dumps(body))
    last = [m for m in body["messages"] if m["role"] != "system"][-1]  # system turns follow
    blocks = last["content"] if isinstance(last["content"], list) else []
    results = any(b.get("type") == "tool_result" for b in blocks)
    for tool in body.get("tools", []):  # on every turn: one prompt, read from the prefix cache
        if tool.get("name") == steering.tool:
            tool["input_schema"] = pinned(steering.argument, steering.value)
    if last["role"] == "user" and not results and steering.marker in _last_text(last["content"]):
        body["tool_choice"] = {"type": "tool", "name": steering.tool}
    else:
        config = body.setdefault("output_config", {})
        config["format"] = {"type": "json_schema", "schema": ANSWER_SCHEMA}
    return body


def steer_responses(body: dict[str, Any], steering: Steering) -> dict[str, Any]:
    """A Responses request, the same way (Codex's)."""
    body = json.loads(json.dumps(body))
    items = body["input"] if isinstance(body["input"], list) else []
    items = [i for i in items if i.get("role") not in ("system", "developer")]
    last = items[-1] if items else {"type": "message", "role": "user", "content": body["input"]}
    asks = last.get("role") == "user" and steering.marker in _last_text(last.get("content", ""))
    for tool in body.get("tools", []):
        if tool.get("name") == steering.tool:
            tool["parameters"] = pinned(steering.argument, steering.value)
            tool["strict"] = True
    if asks:
        body["tool_choice"] = {"type": "function", "name": steering.tool}
    else:
        schema = {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}
        body["text"] = {**body.get("text", {}), "format": {**schema, "strict": True}}
    return body


@dataclass
class AgentProxy:
    """``with AgentProxy(upstream, host) as proxy: proxy.base``; ``proxy.steering`` decides
    which turn calls a tool; ``proxy.exchanges`` holds what passed."""

    upstream: str
    host: str = "127.0.0.1"
    steering: Steering | None = None
    exchanges: list[Exchange] = field(default_factory=list)

    def __post_init__(self):
        from llmq.common.transport.redis_server import free_port

        self.port = free_port()
        self.base = f"http://{self.host}:{self.port}"
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=_METHODS)])
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> AgentProxy:
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "the agent proxy")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def _steered(self, path: str, body: dict[str, Any] | None) -> dict[str, Any] | None:
        if body is None or self.steering is None:
            return body
        if path == "/v1/messages":
            return steer_messages(body, self.steering)
        if path == "/v1/responses":
            return steer_responses(body, self.steering)
        return body

    async def _handle(self, request: Request) -> Response:
        start = time.monotonic()
        raw = await request.body()
        body = json.loads(raw) if raw and request.method == "POST" else None
        sent = self._steered(request.url.path, body)
        content = json.dumps(sent).encode() if sent is not None else raw
        skip = ("host", "content-length", "accept-encoding")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
        url = self.upstream + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        async with httpx.AsyncClient(timeout=600) as client:
            r = await client.request(request.method, url, content=content, headers=headers)
        self.exchanges.append(
            Exchange(
                request.method,
                request.url.path,
                body,
                sent,
                r.status_code,
                r.text,
                time.monotonic() - start,
            )
        )
        drop = ("content-length", "transfer-encoding", "content-encoding")
        out = {k: v for k, v in r.headers.items() if k.lower() not in drop}
        return Response(r.content, status_code=r.status_code, headers=out)

    def since(self, start: int) -> list[Exchange]:
        return self.exchanges[start:]


_METHODS = ["GET", "POST", "HEAD", "DELETE", "PUT", "OPTIONS"]
