"""`llmq inspect`: one screen on the queue, the engines and the batches in progress."""

from __future__ import annotations

import argparse

from llmq.tools.settings_flags import override_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="one screen: queue, engines, batches in progress",
        description="Reads Redis: per request stream its length, pending entries per consumer "
        "and oldest age; per engine its model, KV use, running and waiting; batches in progress.",
    )
    p.add_argument("--redis-url", help="Redis URL (LLMQ_REDIS_URL)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    override_settings(redis_url=args.redis_url)
    from llmq.common.settings import get_settings
    from llmq.tools.inspect_snapshot import show

    return show(get_settings(), as_json=args.json)
