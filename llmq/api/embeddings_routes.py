"""POST /v1/embeddings: tokenize, send to an embeddings worker, shape OpenAI's response."""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from llmq.common.errors import InvalidRequest
from llmq.common.pipeline import check_text

router = APIRouter()

MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    # A string, a list of strings, a list of token ids or a list of lists of token ids; checked
    # by `_inputs` so that a wrong shape gets a message that says what is accepted.
    input: Any
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's extension: cut inputs to this many tokens (-1: the model's limit) instead of a 400.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None


_SHAPE = "a string, an array of strings, an array of token ids or an array of arrays of token ids"


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_row(row: list, where: str) -> list[int]:
    if not row:
        raise InvalidRequest(f"{where} is an empty array of token ids", "input")
    if not all(_is_token(t) for t in row):
        raise InvalidRequest(f"{where} must be {_SHAPE}", "input")
    if any(t < 0 for t in row):
        raise InvalidRequest(f"{where}: token ids must not be negative", "input")
    return row


def _inputs(x: Any) -> list[str | list[int]]:
    """The request's inputs as a list of strings and token-id lists; 400 for anything else."""
    if isinstance(x, str):
        x = [x]
    if not isinstance(x, list):
        raise InvalidRequest(f"input must be {_SHAPE}", "input")
    if not x:
        raise InvalidRequest("input is an empty array", "input")
    if all(_is_token(t) for t in x):
        return [_token_row(x, "input")]
    if len(x) > MAX_INPUTS:
        raise InvalidRequest(
            f"input holds {len(x)} items; at most {MAX_INPUTS} per request", "input"
        )
    items: list[str | list[int]] = []
    for i, item in enumerate(x):
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"input[{i}] is an empty string", "input")
            items.append(item)
        elif isinstance(item, list):
            items.append(_token_row(item, f"input[{i}]"))
        else:
            raise InvalidRequest(f"input[{i}] must be a string or an array of token ids", "input")
    return items


def _special_frame(tok) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after one text ([CLS] and [SEP])."""
    bare = tok.encode("a", add_special_tokens=False)
    full = tok.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    return [], []


def _truncate_text(row: list[int], limit: int, frame: tuple[list[int], list[int]]) -> list[int]:
    """Keep the first tokens of a text's content and its special tokens, as the tokenizer's own
    truncation (and sentence-transformers) does."""
    head, tail = frame
    n = len(head) + len(tail)
    framed = row[: len(head)] == head and (not tail or row[-len(tail) :] == tail)
    if not framed or limit <= n:
        return row[:limit]
    return row[: len(head)] + row[len(head) : len(row) - len(tail)][: limit - n] + tail


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
    items = _inputs(body.input)
    registry = request.app.state.registry
    pipeline, engine = await registry.get(body.model, kind="embed")
    limit = engine.max_model_len
    native = engine.dimensions
    truncatable = engine.matryoshka
    if body.dimensions is not None and body.dimensions != native:  # noqa: SIM102
        if not truncatable or body.dimensions > native:
            raise InvalidRequest(
                f"this model gives {native}-dimensional vectors and does not support other `dimensions`",
                "dimensions",
            )
    truncate = body.truncate_prompt_tokens
    if truncate == 0:
        raise InvalidRequest(
            "truncate_prompt_tokens must be positive (or -1 for the model's limit)",
            "truncate_prompt_tokens",
        )
    if truncate is not None and (truncate == -1 or truncate > limit):
        truncate = limit
    texts = [(i, t) for i, t in enumerate(items) if isinstance(t, str)]
    for i, t in texts:
        check_text(t, f"input[{i}]")
    encoded: list[list[int]] = [[] if isinstance(t, str) else t for t in items]
    tok = pipeline.tokenizer
    if texts:
        # Plain calls only: truncation=... would change the shared tokenizer's settings under
        # the requests tokenizing in other threads.
        ids = await asyncio.to_thread(lambda: tok([t for _, t in texts])["input_ids"])
        for (i, _), row in zip(texts, ids, strict=True):
            encoded[i] = list(row)
    vocab = engine.vocab_size
    frame = None
    for i, row in enumerate(encoded):
        if vocab and any(t >= vocab for t in row):
            raise InvalidRequest(f"input[{i}]: token ids must be below {vocab}", "input")
        if truncate and len(row) > truncate:
            if isinstance(items[i], str):
                frame = frame or _special_frame(tok)
                encoded[i] = row = _truncate_text(row, truncate, frame)
            else:
                encoded[i] = row = row[:truncate]
        if len(row) > limit:
            raise InvalidRequest(
                f"input[{i}] has {len(row)} tokens; this model takes at most {limit} "
                "(or set truncate_prompt_tokens)",
                "input",
                "context_length_exceeded",
            )
    result = await pipeline.embed(encoded, dimensions=body.dimensions)
    if body.encoding_format == "base64":
        data = result.vectors
    else:
        data = [np.frombuffer(base64.b64decode(v), dtype="<f4").tolist() for v in result.vectors]
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(data)],
        "model": pipeline.model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }
