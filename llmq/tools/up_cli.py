"""`llmq up`: everything in one command (see llmq.tools.up)."""

from __future__ import annotations

import argparse

from llmq.tools.settings_flags import override_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="run everything: an embedded Redis (unless LLMQ_REDIS_URL), the workers, the API",
        description="Starts a real Redis on loopback unless LLMQ_REDIS_URL is set, the workers "
        "(one per GPU; on a CPU two, or LLMQ_WORKERS) and the API; Ctrl-C or SIGTERM stops all "
        "of them.",
    )
    p.add_argument("--host", help="API bind address (LLMQ_HOST)")
    p.add_argument("--port", type=int, help="API port (LLMQ_PORT, default 8000)")
    p.add_argument("--model", help="model id or path (LLMQ_MODEL)")
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    override_settings(host=args.host, port=args.port, model=args.model)
    from llmq.tools.up import run_up

    return run_up(log_level=args.log_level)
