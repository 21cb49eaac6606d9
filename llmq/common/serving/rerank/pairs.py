"""(query, document) pairs tokenized together with the tokenizer's pair template ([CLS] query
[SEP] document [SEP] for BERT, <s> query </s></s> document </s> for XLM-RoBERTa), cut to a
length as the tokenizer's own truncation does (longest first), with their token type ids.

A fast tokenizer keeps its truncation setting on its Rust tokenizer, which every request's
thread shares: setting it there would cut the texts of requests tokenizing at the same moment.
Pairs go through a copy of it instead, one per tokenizer, its truncation set under a lock."""

from __future__ import annotations

import threading
import weakref

from llmq.common.errors import InvalidRequest

_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COPIES_LOCK = threading.Lock()


def _pair_tokenizer(tok):
    """The copy of ``tok``'s Rust tokenizer that pairs go through, and its lock (None for a
    tokenizer without one: a slow tokenizer keeps no truncation state)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None
    with _COPIES_LOCK:
        entry = _COPIES.get(tok)
        if entry is None:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(backend.to_str())
            copy.no_padding()
            entry = _COPIES[tok] = (copy, threading.Lock())
    return entry


def special_tokens_of_a_pair(tok) -> int:
    return tok.num_special_tokens_to_add(pair=True)


def encode_pairs(
    tok, pairs: list[tuple[str, str]], max_length: int
) -> tuple[list[list[int]], list[list[int]] | None]:
    """Each pair's token ids, at most ``max_length`` of them, and their token type ids (None
    where the tokenizer gives none or all zeros). Runs in a worker thread."""
    if max_length <= special_tokens_of_a_pair(tok) + 1:
        raise InvalidRequest(
            f"truncate_prompt_tokens ({max_length}) leaves no room for a query and a document",
            "truncate_prompt_tokens",
        )
    entry = _pair_tokenizer(tok)
    if entry is not None:
        copy, lock = entry
        with lock:
            copy.enable_truncation(max_length, strategy="longest_first")
            encodings = copy.encode_batch(pairs, add_special_tokens=True)
        ids = [list(e.ids) for e in encodings]
        types = [list(e.type_ids) for e in encodings]
    else:
        out = tok(
            [q for q, _ in pairs], [d for _, d in pairs], truncation=True, max_length=max_length
        )
        ids = [list(row) for row in out["input_ids"]]
        types = [list(row) for row in out.get("token_type_ids") or []] or None
    if types is not None and not any(any(row) for row in types):
        types = None  # one segment type: the worker needs none
    return ids, types
