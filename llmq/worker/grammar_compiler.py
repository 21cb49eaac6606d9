"""Builds llguidance matchers off the engine thread, once per grammar text.

A grammar (the JSON text ``LLMatcher.grammar_from_*`` returns) is parsed into a template
matcher in a small thread pool; every sequence constrained by it gets a ``deep_copy()`` of
the template: a copy costs a small fraction of a build (docs/performance.md, "Choices:
serving"), so a thousand requests with one schema parse it once and copy it on the engine
thread for next to nothing. The tokenizer's llguidance view is built once, in the
pool, for the first grammar, as vLLM builds its grammar backend: a worker that never sees one
does not hold it (nor the Hugging Face tokenizer it is built from: ``LazyTokenizer``, loaded
then).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance

log = logging.getLogger(__name__)

# Template matchers kept; a grammar evicted is built again on its next request.
CACHE_SIZE = 256
BUILD_THREADS = 2


class GrammarError(Exception):
    """A grammar the engine cannot run: it fails the one request that carries it."""


def first_line(message: str) -> str:
    """llguidance errors carry a dump of the parser state after their first line."""
    return message.strip().splitlines()[0] if message.strip() else "grammar error"


@dataclass(frozen=True, slots=True)
class LazyTokenizer:
    """The served tokenizer as a way to load it, and its length (known at start)."""

    load: Callable[[], Any]
    size: int

    def __len__(self) -> int:
        return self.size


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        """``tokenizer``: the served (fast) Hugging Face tokenizer, or a ``LazyTokenizer``;
        ``vocab_size``: the width of the model's logits; ``eos_token_ids``: the tokens that may
        end a grammar."""
        self._pool = ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self.num_builds = 0
        self.vocab_size = max(vocab_size, len(tokenizer))
        if not isinstance(tokenizer, LazyTokenizer):
            tokenizer = LazyTokenizer(lambda loaded=tokenizer: loaded, len(tokenizer))
        self._source, self._eos = tokenizer, sorted(eos_token_ids)
        self._tokenizer: Future | None = None  # the llguidance view, from the first grammar on

    def template(self, grammar: str) -> Future[llguidance.LLMatcher]:
        """The template matcher of ``grammar``, built or being built (never consume tokens
        into it: ``deep_copy()`` it). Its exception: a GrammarError."""
        with self._lock:
            future = self._templates.get(grammar)
            if future is not None:
                self._templates.move_to_end(grammar)
                return future
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(
                    _ll_tokenizer, self._source, self.vocab_size, self._eos
                )
            future = self._pool.submit(self._build, grammar)
            self._templates[grammar] = future
            self.num_builds += 1
            if len(self._templates) > CACHE_SIZE:
                self._templates.popitem(last=False)
            return future

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        tokenizer = self._tokenizer.result()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {first_line(matcher.get_error())}")
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _ll_tokenizer(source: LazyTokenizer, vocab_size: int, eos_token_ids: list[int]):
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(
            source.load(), n_vocab=vocab_size, eos_token=eos_token_ids or None
        )
    except ValueError as exc:  # not a fast tokenizer
        raise GrammarError(f"this model's tokenizer cannot run grammars: {exc}") from exc
