"""`llmq make-model PATH`: a model with random weights and a locally trained tokenizer."""

from __future__ import annotations

import argparse
from typing import get_args

from llmq.tools.model_factory import CLI_ARCHS, Size


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-model",
        help="build a model with random weights and a locally trained tokenizer",
        description="Build a model with random weights (seeded) and a byte-level BPE tokenizer "
        "trained on local text; saved with save_pretrained, so it loads like any model.",
    )
    p.add_argument("path", help="folder to write")
    p.add_argument(
        "--arch",
        choices=list(CLI_ARCHS),
        default="llama",
        help="gemma3 is its text model; qwen3_moe at the tiny and moe-1b sizes only",
    )
    p.add_argument("--size", choices=list(get_args(Size)), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="TOKENS",
        help="the model's longest sequence (max_position_embeddings), e.g. 131072 for agent "
        "apps whose first prompts run to 9k tokens; default: the size's own (2048 for tiny)",
    )
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    from llmq.tools.model_factory import make_model

    path = make_model(
        args.path, arch=args.arch, size=args.size, seed=args.seed, context=args.context
    )
    context = f" ({args.context}-token context)" if args.context else ""
    print(f"wrote a {args.size} {args.arch} model{context} with random weights to {path}")
    return 0
