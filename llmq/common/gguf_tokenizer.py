"""A GGUF file's tokenizer and chat template, from its metadata, without torch; converted once
and cached by the file's hash.

transformers builds the tokenizer a GGUF file describes (``gguf_file=``), but its metadata
reader imports torch, which the API process must not. This reads the same keys with llmq's
header reader (``common/gguf_file.py``, numpy only) and hands them to transformers' converter
(``convert_gguf_tokenizer``), as ``get_gguf_tokenizer`` would. The conversion itself (building
the vocabulary and merges into a ``tokenizers`` model) is most of a first start's tokenizer
cost (docs/performance.md, "Start-up: a GGUF's load"), so the converted tokenizer is saved
under ``<LLMQ_TOKENIZER_CACHE_DIR>/<sha256 of the file>`` and read from there by every later
start, the worker's and the API's alike.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

_FLAGS = ("add_bos_token", "add_eos_token")


def _metadata(path: str | Path) -> dict:
    """The file's metadata values by key (strings decoded, arrays as lists)."""
    try:
        from llmq.common.gguf_file import GGUFFile
    except ImportError as exc:
        raise ImportError("serving a GGUF file needs the gguf package: pip install gguf") from exc
    return GGUFFile.read(path).metadata()


def convert_gguf_tokenizer(path: str | Path):
    """A ``PreTrainedTokenizerFast`` from the metadata of the GGUF file at ``path`` (no
    cache)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    metadata = _metadata(path)
    grouped = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # as transformers' reader defaults it
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def cache_root() -> Path:
    from llmq.common.settings import get_settings

    chosen = get_settings().tokenizer_cache_dir
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmq" / "tokenizers"


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer of the GGUF file at ``path``: from the cache when this file's was
    converted before, else converted and cached. A process that finds another converting the
    same file waits for it (a file lock) and reads its result."""
    from transformers import PreTrainedTokenizerFast

    started = time.monotonic()
    digest = file_sha256(path)
    hashed = time.monotonic() - started
    entry = cache_root() / digest
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (entry / "tokenizer.json").exists():
            config = json.loads((entry / "tokenizer_config.json").read_text())
            flags = {k: v for k, v in config.items() if k in _FLAGS}  # not read from the file
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(entry), **flags)
            if "added_tokens_decoder" not in config:  # cached before the config named them
                with contextlib.suppress(OSError):  # best effort, as the cache is
                    _keep_flags(tokenizer, entry / "tokenizer_config.json")
            log.info(
                "load phase: tokenizer of %s read from its cache %s in %.2f s (%.2f s of it "
                "hashing the file)",
                Path(path).name,
                entry,
                time.monotonic() - started,
                hashed,
            )
            return tokenizer
        tokenizer = convert_gguf_tokenizer(path)
        _save(tokenizer, entry)
    log.info(
        "load phase: tokenizer of %s converted from the file's metadata in %.2f s, cached in %s",
        Path(path).name,
        time.monotonic() - started,
        entry,
    )
    return tokenizer


def _keep_flags(tokenizer, config_path: Path) -> None:
    """``add_bos_token`` and ``add_eos_token`` as the conversion set them: save_pretrained
    leaves them to the post-processor (and from_pretrained does not read them back), so a cached
    Gemma tokenizer said False while adding BOS. And the added tokens as ``tokenizer.json``
    lists them: without them in the config, from_pretrained parses the whole ``tokenizer.json``
    again in Python for that list alone (Gemma 3's 33 MB: 1-2 s of a start)."""
    config = json.loads(config_path.read_text())
    for flag in _FLAGS:
        if getattr(tokenizer, flag, None) is not None:
            config[flag] = getattr(tokenizer, flag)
    fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    config["added_tokens_decoder"] = {
        str(index): {f: getattr(token, f) for f in fields}
        for index, token in tokenizer.added_tokens_decoder.items()
    }
    written = config_path.with_suffix(".partial")  # a reader sees the old config or the new
    written.write_text(json.dumps(config, indent=2))
    written.replace(config_path)


def _save(tokenizer, entry: Path) -> None:
    """Saved whole or not at all: written beside the entry, then renamed into place (best
    effort: a read-only cache leaves the conversion to every start)."""
    partial = None
    try:
        partial = Path(tempfile.mkdtemp(prefix=entry.name + ".", dir=entry.parent))
        tokenizer.save_pretrained(str(partial))
        _keep_flags(tokenizer, partial / "tokenizer_config.json")
        partial.rename(entry)
    except OSError as exc:
        log.warning("the converted tokenizer was not cached in %s: %s", entry, exc)
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
