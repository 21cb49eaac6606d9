"""`llmq batch submit FILE.jsonl [--wait]`: the OpenAI Batch API from the command line."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    batch = subparsers.add_parser("batch", help="batch jobs (the OpenAI Batch API)")
    batch_sub = batch.add_subparsers(dest="batch_command", required=True)
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
        # the store's BATCH_ENDPOINTS, spelled out: importing the store (and redis) would
        # slow down every `llmq` command
        choices=[
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/embeddings",
            "/v1/rerank",
            "/v1/score",
            "/v1/messages",
        ],
        help="the batch's endpoint (default: the url of the file's first line)",
    )
    p.add_argument("--base-url", help="API URL (default http://LLMQ_HOST:LLMQ_PORT)")
    p.add_argument("--api-key", help="API key (LLMQ_API_KEY; the first of several)")
    p.add_argument("--output", help="where to write the output (default FILE.output.jsonl)")
    p.set_defaults(func=run_submit, parser=p)


def run_submit(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmq.common.settings import get_settings
    from llmq.tools.batch_submit import submit

    settings = get_settings()
    base = args.base_url or f"http://{settings.host}:{settings.port}"
    return submit(
        Path(args.file),
        base,
        args.api_key or next(iter(settings.api_keys()), None),  # the first tenant's
        args.endpoint,
        args.wait,
        Path(args.output) if args.output else None,
    )
