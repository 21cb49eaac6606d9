"""The `llmq` command line. Flags override the matching ``LLMQ_`` settings.

Each verb lives in a module of ``llmq.tools`` whose ``register(subparsers)`` adds its parser and
sets ``func`` (what runs) and ``parser`` (which reports its errors); this module builds the
top-level parser from them, dispatches, and turns an operator's mistake into one line."""

from __future__ import annotations

import argparse
import logging
import sys

from llmq.tools import (
    api_cli,
    batch_cli,
    bench_cli,
    flower_cli,
    inspect_cli,
    make_model_cli,
    up_cli,
    worker_cli,
)

# In the order `llmq --help` lists them.
VERBS = (make_model_cli, worker_cli, api_cli, up_cli, flower_cli, batch_cli, inspect_cli, bench_cli)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmq", description="OpenAI-compatible LLM serving on Celery and Redis."
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level (default INFO)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for verb in VERBS:
        verb.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Unknown arguments are reported by the verb's own parser, with its usage.
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args) or 0
    except BrokenPipeError:  # `llmq inspect | head` (an OSError: caught before those)
        sys.stderr.close()
        return 0
    except operator_errors() as exc:  # a missing file, a Redis or API not there, a bad value
        print(f"llmq {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 1


def operator_errors() -> tuple[type[Exception], ...]:
    import httpx
    import pydantic
    from redis.exceptions import ConnectionError as RedisConnectionError

    return (
        OSError,
        RedisConnectionError,
        httpx.TransportError,
        pydantic.ValidationError,
        ValueError,
    )


def _one_line(exc: Exception) -> str:
    import httpx
    import pydantic
    from redis.exceptions import AuthenticationError

    if isinstance(exc, pydantic.ValidationError):  # a bad LLMQ_ variable
        return "; ".join(
            f"LLMQ_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
    if isinstance(exc, AuthenticationError):  # redis-py's words name HELLO, not the cause
        return (
            "Redis refused the password of its URL (none, or a wrong one); give it as "
            "redis://:PASSWORD@HOST:PORT/0 (`llmq up` keeps its own in its state file)"
        )
    if isinstance(exc, httpx.TransportError):
        try:
            return f"cannot reach {exc.request.url}: {exc}"
        except RuntimeError:  # raised without its request
            return str(exc)
    return str(exc) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
