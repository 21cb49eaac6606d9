"""What a tokenizer's own description proves about a text's token count before it is tokenized.

Two facts, each derived from ``tokenizer.json`` (the fast tokenizer's pipeline: normalizer,
pre-tokenizer, model, added tokens) and only where they hold for every input:

- A length bound: every character of the text is covered by some token and no token covers more
  than ``chars_per_token`` characters, so a text of ``n`` characters has at least
  ``ceil(n / chars_per_token)`` tokens (and likewise in UTF-8 bytes for byte-level BPE with no
  normalizer). It holds for BPE over a complete byte alphabet (byte-level, or byte fallback)
  whose pre-tokenizer drops nothing; a normalizer's worst shrink is folded in (NFC turns at most
  4 characters into one, NFKC 18). WordPiece (a word too long becomes one [UNK]), a
  pre-tokenizer that drops whitespace, or an unknown normalizer: no length bound.
- Safe cuts: a position just before a space that follows a non-space character is a boundary
  the pre-tokenizer always splits at, for the pre-tokenizers named below. Tokenizing the text up
  to such a cut gives the first tokens of the whole text (so their count is a lower bound of
  its count), and tokenizing from such a cut gives its last tokens (``tail_cuts``: no
  normalizer or added token that acts on a piece's edges).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

# Most characters one character decomposes into (Unicode 14: U+1F82 into 4; U+FDFA into 18
# under compatibility): a composing normalizer shrinks a text at most by these factors.
NFD_MAX = 4
NFKD_MAX = 18

# Pre-tokenizer regexes (Llama 3, Qwen2) under which no piece holds a non-space character
# followed by a space: every alternative ends at a letter, digit, punctuation or newline, or
# is a run of whitespace alone.
_KNOWN_SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# A space after a non-space: where a text may be cut (a lookbehind, so the space starts the
# next piece).
SAFE_CUT = re.compile(r"(?<=\S) ")


@dataclass(frozen=True, slots=True)
class TokenizerProfile:
    chars_per_token: int | None  # None: no length bound can be proven
    bytes_per_token: int | None  # UTF-8 bytes, where the raw text's bytes are what BPE sees
    prefix_cuts: bool  # SAFE_CUT positions split the whole text's tokens
    tail_cuts: bool  # ... and a piece from such a cut tokenizes as the whole text's tail

    def least_tokens(self, text: str) -> int:
        """A lower bound of the tokens of ``text`` from its length alone (0: none proven)."""
        if self.chars_per_token is None:
            return 0
        least = -(-len(text) // self.chars_per_token)
        if self.bytes_per_token is not None and not text.isascii():
            least = max(least, -(-len(text.encode("utf-8")) // self.bytes_per_token))
        return least


_NO_PROFILE = TokenizerProfile(None, None, False, False)


def tokenizer_profile(tokenizer) -> TokenizerProfile:
    """The profile of a transformers tokenizer (a slow one, without tokenizer.json: none)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return _NO_PROFILE if backend is None else profile_of(backend)


def profile_of(backend) -> TokenizerProfile:
    """The profile of a ``tokenizers.Tokenizer``."""
    spec = json.loads(backend.to_str())
    added = spec.get("added_tokens") or []
    if any(" " in a["content"] for a in added):  # a cut could fall inside one
        return _NO_PROFILE
    normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    prefix = _cuttable(pre) and _local(normalizer, edges=True)
    tail = (
        prefix
        and _local(normalizer, edges=False)
        and not any(a.get("rstrip") for a in added)  # it would take the space a tail starts with
    )
    chars, nbytes = _length_bound(spec, backend, normalizer, pre, added)
    return TokenizerProfile(chars, nbytes, prefix, tail)


# ---- the length bound ----------------------------------------------------------------------


def _length_bound(spec, backend, normalizer, pre, added) -> tuple[int | None, int | None]:
    model = spec.get("model") or {}
    shrink = _shrink(normalizer)
    if model.get("type") != "BPE" or shrink is None or not _keeps_all(pre):
        return None, None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, None
    vocab = backend.get_vocab(with_added_tokens=False)
    added_chars = max((len(a["content"]) for a in added), default=1)
    if _byte_level(pre):
        from tokenizers.pre_tokenizers import ByteLevel

        if not all(c in vocab for c in ByteLevel.alphabet()):
            return None, None  # a byte with no token: BPE would drop it
        longest = max(len(t) for t in vocab)  # one alphabet character per byte
        added_bytes = max((len(a["content"].encode()) for a in added), default=1)
        nbytes = max(longest, added_bytes) if normalizer is None else None
        return max(longest, added_chars) * shrink, nbytes
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        longest = max(1 if _is_byte_token(t) else len(t) for t in vocab)
        return max(longest, added_chars) * shrink, None
    return None, None


def _is_byte_token(token: str) -> bool:
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def _shrink(normalizer: dict | None) -> int | None:
    """How many characters of a text at most become one character of the normalized text (None:
    no bound, e.g. a normalizer that deletes)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):
        return 1
    if kind == "NFC":
        return NFD_MAX
    if kind == "NFKC":
        return NFKD_MAX
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content") or ""
        literal = pattern.get("String")
        if not literal or not content:
            return None
        return max(1, math.ceil(len(literal) / len(content)))
    if kind == "Sequence":
        total = 1
        for part in normalizer.get("normalizers") or []:
            factor = _shrink(part)
            if factor is None:
                return None
            total *= factor
        return total
    return None


def _pre_parts(pre: dict | None) -> list[dict]:
    if pre is None:
        return []
    if pre.get("type") == "Sequence":
        return [p for part in pre.get("pretokenizers") or [] for p in _pre_parts(part)]
    return [pre]


def _keeps_all(pre: dict | None) -> bool:
    """The pre-tokenizer passes every character on (none removes whitespace or delimiters)."""
    kept = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
    return all(
        p.get("type") in kept and p.get("behavior", "Isolated") != "Removed"
        for p in _pre_parts(pre)
    )


def _byte_level(pre: dict | None) -> bool:
    return any(p.get("type") == "ByteLevel" for p in _pre_parts(pre))


# ---- safe cuts -----------------------------------------------------------------------------


def _cuttable(pre: dict | None) -> bool:
    """Whether the pre-tokenizer always splits before a space that follows a non-space."""
    parts = _pre_parts(pre)
    if not parts:
        return False  # no pre-tokenizer: BPE runs over the whole text as one word
    splits = False
    for p in parts:
        kind = p.get("type")
        if kind in ("BertPreTokenizer", "Whitespace", "WhitespaceSplit"):
            splits = True
        elif kind == "ByteLevel":
            splits = splits or bool(p.get("use_regex", True))
        elif kind == "Metaspace":
            splits = splits or bool(p.get("split", True))
        elif kind == "Split":
            if (p.get("pattern") or {}).get("Regex") not in _KNOWN_SPLITS or p.get("invert"):
                return False
            splits = True
        elif kind not in ("Digits", "Punctuation"):
            return False
    return splits


def _local(normalizer: dict | None, edges: bool) -> bool:
    """Whether normalizing a piece cut before a space normalizes it as within the whole text.
    ``edges``: a piece starting the text (a prefix) may meet a normalizer acting on the start."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_local(n, edges) for n in normalizer.get("normalizers") or [])
    if kind == "Replace":
        literal = (normalizer.get("pattern") or {}).get("String")
        return literal is not None and len(literal) == 1
    if kind in ("Prepend", "Strip"):
        return edges
    # One character at a time, or compositions that a space never joins.
    return kind in (
        "NFC",
        "NFD",
        "NFKC",
        "NFKD",
        "Lowercase",
        "BertNormalizer",
        "StripAccents",
        "ByteLevel",
    )


def cut_at_or_before(text: str, at: int, floor: int) -> int | None:
    """The last safe cut in ``(floor, at]``, else the first after ``at`` (None: no cut)."""
    last = None
    for m in SAFE_CUT.finditer(text, max(floor, 1), min(at, len(text) - 1) + 1):
        last = m.start()
    if last is not None:
        return last
    m = SAFE_CUT.search(text, min(at, len(text)))
    return m.start() if m else None


def cut_at_or_after(text: str, at: int) -> int | None:
    """The first safe cut at or after ``at`` (None: none)."""
    m = SAFE_CUT.search(text, max(at, 1))
    return m.start() if m else None
