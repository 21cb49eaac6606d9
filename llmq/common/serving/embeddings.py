"""/v1/embeddings: inputs checked and tokenized, truncated or refused at the model's limit,
embedded on an embeddings worker, answered as OpenAI's list of embeddings."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from llmq.common.engine_client.pipeline import EmbeddingResult, TokenGeneratorPipeline
from llmq.common.engine_client.prompt_encoder import FIRST_PIECE, TooManyTokens
from llmq.common.engine_client.text_input import check_text
from llmq.common.engine_client.tokenize_pool import utf8_size
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import InvalidRequest
from llmq.common.serving.request_bodies import MAX_INPUTS, EmbeddingRequest
from llmq.common.serving.responses import Embedding, EmbeddingList, EmbeddingUsage
from llmq.common.serving.submission import SubmitOptions

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


def embedding_inputs(x: Any) -> list[str | list[int]]:
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


def _check_dimensions(body: EmbeddingRequest, engine: EngineStatus) -> None:
    native = engine.dimensions
    if body.dimensions is None or body.dimensions == native:
        return
    if not engine.matryoshka or body.dimensions > native:
        raise InvalidRequest(
            f"this model gives {native}-dimensional vectors and does not support other `dimensions`",
            "dimensions",
        )


def _truncation(body: EmbeddingRequest, limit: int) -> int | None:
    """The tokens each input is cut to (None: refuse inputs over the model's limit)."""
    truncate = body.truncate_prompt_tokens
    if truncate == 0:
        raise InvalidRequest(
            "truncate_prompt_tokens must be positive (or -1 for the model's limit)",
            "truncate_prompt_tokens",
        )
    if truncate is not None and (truncate == -1 or truncate > limit):
        return limit
    return truncate


async def _tokenized(
    pipeline: TokenGeneratorPipeline, items: list[str | list[int]], limit: int, truncate
) -> list[list[int]]:
    """Each input's token ids: short texts in batches of a bounded size, long ones each cut
    as ``truncate`` keeps them, or refused past ``limit`` without tokenizing them whole."""
    texts = [(i, t) for i, t in enumerate(items) if isinstance(t, str)]
    for i, t in texts:
        check_text(t, f"input[{i}]")
    encoded: list[list[int]] = [[] if isinstance(t, str) else t for t in items]
    short = [(i, t) for i, t in texts if len(t) <= FIRST_PIECE]
    for batch in _batches(short, pipeline.encoder.pool.small_bytes):
        for (i, _), row in zip(batch, await _encode_batch(pipeline, batch), strict=True):
            encoded[i] = list(row)
    for i, t in texts:
        if len(t) <= FIRST_PIECE:
            continue
        try:
            encoded[i] = await pipeline.encoder.encode(
                t, most=None if truncate else limit, keep_first=truncate
            )
        except TooManyTokens as exc:
            raise InvalidRequest(
                f"input[{i}] has at least {exc.at_least} tokens; this model takes at most "
                f"{limit} (or set truncate_prompt_tokens)",
                "input",
                "context_length_exceeded",
            ) from None
    return encoded


def _batches(texts: list[tuple[int, str]], most_bytes: int) -> list[list[tuple[int, str]]]:
    """The texts in order, in batches of at most ``most_bytes`` (or of one text)."""
    batches: list[list[tuple[int, str]]] = []
    size = 0
    for item in texts:
        n = utf8_size(item[1])
        if not batches or size + n > most_bytes:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += n
    return batches


async def _encode_batch(pipeline: TokenGeneratorPipeline, batch: list[tuple[int, str]]):
    tok, texts = pipeline.tokenizer, [t for _, t in batch]
    # Plain calls only: truncation=... would change the shared tokenizer's settings under
    # the requests tokenizing in other threads.
    size = sum(utf8_size(t) for t in texts)
    return await pipeline.encoder.pool.run(size, lambda: tok(texts)["input_ids"])


def _fitted(
    tok, items: list[str | list[int]], encoded: list[list[int]], engine: EngineStatus, truncate
) -> list[list[int]]:
    """Every row within the vocabulary and the model's limit (cut to ``truncate`` first)."""
    vocab, limit = engine.vocab_size, engine.max_model_len
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
    return encoded


def _embedding_list(result: EmbeddingResult, encoding_format: str, model: str) -> EmbeddingList:
    if encoding_format == "base64":
        data: list = result.vectors
    else:
        data = [np.frombuffer(base64.b64decode(v), dtype="<f4").tolist() for v in result.vectors]
    return EmbeddingList(
        # Built unvalidated: the vectors are floats already (up to 2048 x dims of them).
        data=[Embedding.model_construct(index=i, embedding=v) for i, v in enumerate(data)],
        model=model,
        usage=EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens),
    )


async def embed(
    pipeline: TokenGeneratorPipeline,
    engine: EngineStatus,
    body: EmbeddingRequest,
    items: list[str | list[int]],
    options: SubmitOptions,
) -> EmbeddingList:
    """Embed ``items`` (the body's inputs, checked by ``embedding_inputs``)."""
    _check_dimensions(body, engine)
    truncate = _truncation(body, engine.max_model_len)
    tok = pipeline.tokenizer
    tokenized = await _tokenized(pipeline, items, engine.max_model_len, truncate)
    encoded = _fitted(tok, items, tokenized, engine, truncate)
    result = await pipeline.embed(
        encoded,
        dimensions=body.dimensions,
        request_id=options.request_id(0),
        priority=options.priority,
        attach=options.attach,
    )
    return _embedding_list(result, body.encoding_format, pipeline.model)
