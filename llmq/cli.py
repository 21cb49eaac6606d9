"""The `llmq` command line. Flags override the matching ``LLMQ_`` settings."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys


def _make_model(args: argparse.Namespace) -> int:
    from llmq.common.model_factory import make_model

    path = make_model(args.path, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote a {args.size} {args.arch} model with random weights to {path}")
    return 0


def _override(**values) -> None:
    """Map CLI flags onto settings: they become LLMQ_ variables, which child processes inherit
    and the Settings class reads."""
    from llmq.common.settings import get_settings

    for name, value in values.items():
        if value is not None:
            os.environ[f"LLMQ_{name.upper()}"] = str(value)
    get_settings.cache_clear()


def _worker(args: argparse.Namespace) -> int:
    # Idle OpenMP threads spin briefly, then sleep (read when torch loads). A step runs
    # ~2,400 parallel regions back to back: sleeping between them (OMP_WAIT_POLICY=PASSIVE)
    # made a two-thread step twice as slow as one thread; spinning forever takes the cores
    # from Redis and the API between steps. A short spin bridges the gaps inside a step only.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    _override(
        model=args.model,
        worker_name=args.name,
        redis_url=args.redis_url,
        torch_threads=args.torch_threads,
    )
    from llmq.common.settings import get_settings
    from llmq.worker.celery_app import BATCH_QUEUE, app

    settings = get_settings()
    name = settings.worker_name or f"llmq-{os.getpid()}@%h"
    name = name.replace("%h", socket.gethostname())  # Celery's host placeholder
    os.environ["LLMQ_WORKER_NAME"] = name
    get_settings.cache_clear()
    argv = [
        "worker",
        "--pool=threads",
        f"--concurrency={args.concurrency}",
        f"--queues={BATCH_QUEUE}",
        f"--hostname={name}",
        f"--loglevel={args.log_level}",
        "--without-gossip",
        "--without-mingle",
        "--task-events",
    ]
    app.worker_main(argv)
    return 0


def _api(args: argparse.Namespace) -> int:
    _override(host=args.host, port=args.port, redis_url=args.redis_url, model=args.model)
    import uvicorn

    from llmq.api.app import create_app
    from llmq.common.settings import get_settings

    settings = get_settings()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=5,
    )
    return 0


def _up(args: argparse.Namespace) -> int:
    _override(host=args.host, port=args.port, model=args.model)
    from llmq.up import run_up

    return run_up(log_level=args.log_level)


def _flower(args: argparse.Namespace) -> int:
    _override(redis_url=args.redis_url, flower_port=args.port, flower_host=args.host)
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
        f"--basic-auth={settings.flower_user}:{password}",
    ]
    os.execv(sys.executable, argv)
    return 0


def _batch_submit(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmq.common.settings import get_settings
    from llmq.tools.batch_cli import submit

    settings = get_settings()
    base = args.base_url or f"http://{settings.host}:{settings.port}"
    return submit(
        Path(args.file),
        base,
        args.api_key or settings.api_key,
        args.endpoint,
        args.wait,
        Path(args.output) if args.output else None,
    )


def _inspect(args: argparse.Namespace) -> int:
    _override(redis_url=args.redis_url)
    from llmq.common.settings import get_settings
    from llmq.tools.inspect_cli import run

    return run(get_settings(), as_json=args.json)


def _bench(args: argparse.Namespace) -> int:
    from llmq.tools.bench_cli import run

    return run(args)


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
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "make-model",
        help="build a model with random weights and a locally trained tokenizer",
        description="Build a model with random weights (seeded) and a byte-level BPE tokenizer "
        "trained on local text; saved with save_pretrained, so it loads like any model.",
    )
    p.add_argument("path", help="folder to write")
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--size", choices=["tiny", "smollm2-135m"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_model, parser=p)

    p = sub.add_parser(
        "worker",
        help="run a Celery worker that holds the model and runs the engine",
        description="A Celery worker (threads pool) whose engine loop serves the model's "
        "request stream; it also runs batch-job tasks.",
    )
    p.add_argument("--name", help="worker name (LLMQ_WORKER_NAME); default llmq-PID@HOST")
    p.add_argument("--model", help="model id or path (LLMQ_MODEL)")
    p.add_argument("--redis-url", help="Redis URL (LLMQ_REDIS_URL)")
    p.add_argument("--torch-threads", type=int, help="torch threads (LLMQ_TORCH_THREADS)")
    p.add_argument("--concurrency", type=int, default=4, help="batch-task threads (default 4)")
    p.set_defaults(func=_worker, parser=p)

    p = sub.add_parser(
        "api",
        help="run the OpenAI-compatible HTTP API",
        description="The API (FastAPI on uvicorn): tokenizes, enqueues to Redis, streams back.",
    )
    p.add_argument("--host", help="bind address (LLMQ_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (LLMQ_PORT, default 8000)")
    p.add_argument("--model", help="default model (LLMQ_MODEL)")
    p.add_argument("--redis-url", help="Redis URL (LLMQ_REDIS_URL)")
    p.set_defaults(func=_api, parser=p)

    p = sub.add_parser(
        "up",
        help="run everything: an embedded Redis (unless LLMQ_REDIS_URL), the workers, the API",
        description="Starts a real Redis on loopback unless LLMQ_REDIS_URL is set, the workers "
        "(one per GPU; on a CPU two, or LLMQ_WORKERS) and the API; Ctrl-C or SIGTERM stops all "
        "of them.",
    )
    p.add_argument("--host", help="API bind address (LLMQ_HOST)")
    p.add_argument("--port", type=int, help="API port (LLMQ_PORT, default 8000)")
    p.add_argument("--model", help="model id or path (LLMQ_MODEL)")
    p.set_defaults(func=_up, parser=p)

    p = sub.add_parser(
        "flower",
        help="run Flower (Celery's dashboard) on the same broker, with basic auth",
        description="Flower on loopback by default, with basic auth from LLMQ_FLOWER_USER / "
        "LLMQ_FLOWER_PASSWORD (a random password is printed when unset).",
    )
    p.add_argument("--host", help="bind address (LLMQ_FLOWER_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (LLMQ_FLOWER_PORT, default 5555)")
    p.add_argument("--redis-url", help="Redis URL (LLMQ_REDIS_URL)")
    p.set_defaults(func=_flower, parser=p)

    p = sub.add_parser("batch", help="batch jobs (the OpenAI Batch API)")
    batch_sub = p.add_subparsers(dest="batch_command", required=True)
    p = batch_sub.add_parser(
        "submit",
        help="upload a JSONL file and run it as a batch",
        description="Uploads FILE (one OpenAI request per line: custom_id, method, url, body), "
        "creates a batch and, with --wait, shows progress and downloads the output.",
    )
    p.add_argument("file", help="the JSONL input file")
    p.add_argument("--wait", action="store_true", help="poll until done, then download")
    p.add_argument(
        "--endpoint",
        choices=["/v1/chat/completions", "/v1/completions", "/v1/embeddings"],
        help="the batch's endpoint (default: the url of the file's first line)",
    )
    p.add_argument("--base-url", help="API URL (default http://LLMQ_HOST:LLMQ_PORT)")
    p.add_argument("--api-key", help="API key (LLMQ_API_KEY)")
    p.add_argument("--output", help="where to write the output (default FILE.output.jsonl)")
    p.set_defaults(func=_batch_submit, parser=p)

    p = sub.add_parser(
        "inspect",
        help="one screen: queue, engines, batches in progress",
        description="Reads Redis: per request stream its length, pending entries per consumer "
        "and oldest age; per engine its model, KV use, running and waiting; batches in progress.",
    )
    p.add_argument("--redis-url", help="Redis URL (LLMQ_REDIS_URL)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_inspect, parser=p)

    p = sub.add_parser(
        "bench",
        help="load generator against any OpenAI-compatible server (llmq, vLLM, ...)",
        description="Streams requests of fixed prompt and output length to an OpenAI-compatible "
        "server, closed loop (--concurrency) or open loop (--rate), and reports TTFT, ITL and "
        "end-to-end percentiles, output tokens/s, requests/s and errors.",
    )
    from llmq.tools.bench_cli import add_arguments as _bench_arguments

    _bench_arguments(p)
    p.set_defaults(func=_bench, parser=p)
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

    if isinstance(exc, pydantic.ValidationError):  # a bad LLMQ_ variable
        return "; ".join(
            f"LLMQ_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
    if isinstance(exc, httpx.TransportError):
        try:
            return f"cannot reach {exc.request.url}: {exc}"
        except RuntimeError:  # raised without its request
            return str(exc)
    return str(exc) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
