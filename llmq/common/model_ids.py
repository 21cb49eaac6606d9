"""Model ids users can type: ``smollm2-135m-instruct`` for ``.../SmolLM2-135M-Instruct.Q4_1.gguf``
or ``HuggingFaceTB/SmolLM2-135M-Instruct``, as Ollama and vLLM users name models."""

from __future__ import annotations

import re
from collections.abc import Iterable

# A GGUF file's quantization at the end of its name (``.Q4_1``, ``-q4_k_m``, ``-IQ4_XS``,
# ``.F16``): the same weights in another file are the same model to the user.
_QUANT_SUFFIX = re.compile(r"[._-](?:i?q\d\w*|f16|f32|bf16|fp16)$", re.IGNORECASE)
_UNTYPABLE = re.compile(r"[^a-z0-9._-]+")


def short_id(source: str) -> str:
    """The id of a model's source (a hub id, a folder, a GGUF file): its last name, without a
    ``.gguf`` and a quantization suffix, lower-case; ``source`` itself where that leaves
    nothing."""
    name = source.rstrip("/").rsplit("/", 1)[-1]
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    name = _QUANT_SUFFIX.sub("", name)
    name = _UNTYPABLE.sub("-", name.lower()).strip("-.")
    return name or source


def resolve_alias(name: str, known: dict[str, dict], live: Iterable[str] = ()) -> str | None:
    """The served model ``name`` means when it is no served name: the one whose source is
    ``name``, or whose short id is. Among several, those a live worker serves; None where none
    or still several are meant (the caller says which)."""
    matches = alias_candidates(name, known)
    if len(matches) > 1:
        serving = set(live)
        matches = [m for m in matches if m in serving] or matches
    return matches[0] if len(matches) == 1 else None


def alias_candidates(name: str, known: dict[str, dict]) -> list[str]:
    """Every served model ``name`` could mean (for the message of an ambiguous one)."""
    return sorted(
        served
        for served, record in known.items()
        if name in (record.get("source"), short_id(record.get("source") or served))
        or name == short_id(served)
    )
