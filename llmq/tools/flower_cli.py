"""`llmq flower`: Flower (Celery's dashboard) on the same broker, with basic auth."""

from __future__ import annotations

import argparse
import os
import sys

from llmq.tools.settings_flags import override_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "flower",
        help="run Flower (Celery's dashboard) on the same broker, with basic auth",
        description="Flower on loopback by default, with basic auth from LLMQ_FLOWER_USER / "
        "LLMQ_FLOWER_PASSWORD (a random password is printed when unset).",
    )
    p.add_argument("--host", help="bind address (LLMQ_FLOWER_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (LLMQ_FLOWER_PORT, default 5555)")
    p.add_argument("--redis-url", help="Redis URL (LLMQ_REDIS_URL)")
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    """Replaces this process with `celery flower` (os.execv does not return)."""
    override_settings(redis_url=args.redis_url, flower_port=args.port, flower_host=args.host)
    import secrets

    from llmq.common.settings import get_settings

    settings = get_settings()
    password = settings.flower_password
    if not password:
        password = secrets.token_urlsafe(12)
        print(f"llmq: Flower user {settings.flower_user!r}, password {password!r}", flush=True)
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "llmq.worker.celery_app",
        "flower",
        f"--port={settings.flower_port}",
        f"--address={settings.flower_host}",
    ]
    # Flower reads FLOWER_<OPTION> from its environment: the password stays out of argv,
    # where `ps` shows it to every local user.
    os.environ["FLOWER_BASIC_AUTH"] = f"{settings.flower_user}:{password}"
    os.execv(sys.executable, argv)
    return 0
