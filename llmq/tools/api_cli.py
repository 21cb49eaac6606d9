"""`llmq api`: the OpenAI-compatible HTTP API on uvicorn."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from llmq.tools.settings_flags import override_settings

if TYPE_CHECKING:
    from llmq.common.settings import Settings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "api",
        help="run the OpenAI-compatible HTTP API",
        description="The API (FastAPI on uvicorn): tokenizes, enqueues to Redis, streams back.",
    )
    p.add_argument("--host", help="bind address (LLMQ_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (LLMQ_PORT, default 8000)")
    p.add_argument("--model", help="default model (LLMQ_MODEL)")
    p.add_argument("--redis-url", help="Redis URL (LLMQ_REDIS_URL)")
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    override_settings(host=args.host, port=args.port, redis_url=args.redis_url, model=args.model)
    from llmq.common.settings import get_settings

    serve_api(get_settings(), args.log_level)
    return 0


def serve_api(settings: Settings, log_level: str) -> None:
    """Run the API in this process until a signal stops it (used by `llmq api` and `llmq up`)."""
    import uvicorn

    from llmq.api.app import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=5,
    )
