"""Prompts for `llmq bench`: random words of an exact token count where a tokenizer is at hand
(the chat template included for the chat endpoint), short common words where none is."""

from __future__ import annotations

import functools
import os
import random
import re
from dataclasses import dataclass

# Single-token words per tokenizer: finding them decodes up to 20,000 vocabulary entries.
_WORDS: dict = {}


class PromptBuilder:
    """Random prompts of an exact token count. Each word of the text is one vocabulary token
    with a leading space, so that the pre-tokenizer splits the text at every word and the count
    is the number of words (checked and corrected per prompt)."""

    def __init__(self, tokenizer, endpoint: str, seed: int):
        self.tok = tokenizer
        self.endpoint = endpoint
        self.rng = random.Random(seed)
        key = (id(tokenizer), len(tokenizer))
        if key not in _WORDS:
            _WORDS[key] = self._words()
        self.words = _WORDS[key]
        if not self.words:
            raise ValueError("the tokenizer has no single-token words to build prompts from")

    def _words(self) -> list[str]:
        vocab_size = len(self.tok)
        special = set(getattr(self.tok, "all_special_ids", []) or [])
        ids = [i for i in range(vocab_size) if i not in special]
        rng = random.Random(1234)
        if len(ids) > 20000:
            ids = rng.sample(ids, 20000)
        pieces = []
        for text in self.tok.batch_decode([[i] for i in ids]):
            word = text.strip()
            if 2 <= len(word) <= 12 and re.fullmatch(r"[A-Za-z]+", word):
                pieces.append(" " + word)
        pieces = sorted(set(pieces))
        enc = self.tok(pieces, add_special_tokens=False)["input_ids"]
        return [p for p, e in zip(pieces, enc, strict=True) if len(e) == 1]

    def count(self, text: str) -> int:
        if self.endpoint == "chat":
            ids = self.tok.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return len(ids)
        return len(self.tok.encode(text, add_special_tokens=True))

    def build(self, target: int) -> tuple[str, int]:
        """A prompt of ``target`` tokens (or the nearest reachable); returns it and its length."""
        overhead = self.count(self.words[0]) - 1
        n = max(1, target - overhead)
        words = [self.rng.choice(self.words) for _ in range(n)]
        best = None
        for _ in range(8):
            text = "".join(words).lstrip()
            got = self.count(text)
            if best is None or abs(got - target) < abs(best[1] - target):
                best = (text, got)
            if got == target:
                break
            if got < target:
                words += [self.rng.choice(self.words) for _ in range(target - got)]
            elif len(words) > 1:
                del words[max(1, len(words) - (got - target)) :]
        return best


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(path)


def fallback_prompt(target: int, rng: random.Random) -> str:
    """No tokenizer: about one token per short common word."""
    words = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as"]
    return " ".join(rng.choice(words) for _ in range(target))


@dataclass
class PromptSet:
    """The prompts of one run, with their token counts where a tokenizer measured them."""

    texts: list[str] | list[list[dict[str, str]]]  # prompts, or chats (a workload's)
    lengths: list[int | None]
    note: str | None  # what the report should say about the prompts' lengths, if anything
    measured: bool  # built with a tokenizer: lengths are exact counts

    @property
    def length_range(self) -> list[int] | None:
        return [min(self.lengths), max(self.lengths)] if self.measured else None


def build_prompts(
    tokenizer_path: str | None, endpoint: str, seed: int, count: int, target: int
) -> PromptSet:
    """``count`` prompts of ``target`` tokens each (as near as the tokenizer allows)."""
    rng = random.Random(seed)
    builder = None
    note = None
    if tokenizer_path:
        builder = PromptBuilder(load_tokenizer(tokenizer_path), endpoint, seed)
    else:
        note = "no tokenizer (--tokenizer): prompt lengths are approximate"
    texts: list[str] = []
    lengths: list[int | None] = []
    for _ in range(count):
        if builder:
            text, n = builder.build(target)
        else:
            text, n = fallback_prompt(target, rng), None
        texts.append(text)
        lengths.append(n)
    if builder and any(n != target for n in lengths):
        note = f"prompt lengths {min(lengths)}..{max(lengths)} (asked {target})"
    return PromptSet(texts, lengths, note, measured=builder is not None)
