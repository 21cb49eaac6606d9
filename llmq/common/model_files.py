"""A model's files, a Hugging Face id or a local folder alike: where one is (``model_file``, a
GGUF's ``gguf_location``) and its tokenizer, which the API and the worker both load. No torch:
the model itself loads in the worker (``worker/loading/model_loader.py``)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


_TOKENIZER_LOAD = threading.Lock()


def load_tokenizer(model: str):
    """The model's tokenizer. A fast tokenizer (tokenizer.json) loads without the model
    classes, so the API never imports torch; others go through AutoTokenizer. One load at a
    time: transformers imports its classes lazily, and two threads importing at once (the
    default model's preload and a first request for another model) made one of them fail
    with "cannot import name 'PreTrainedTokenizerFast'"."""
    with _TOKENIZER_LOAD:
        started = time.monotonic()
        tokenizer = _load_tokenizer(model)
    if gguf_location(model) is None:  # a GGUF's tokenizer reports its own (cached or not)
        log.info("load phase: tokenizer of %s in %.2f s", model, time.monotonic() - started)
    return tokenizer


def gguf_location(model: str) -> tuple[str, str] | None:
    """(folder, file name) where ``model`` is a GGUF file, or a folder holding one GGUF file
    and no transformers checkpoint; None otherwise."""
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return str(path.parent), path.name
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(p.name for p in path.glob("*.gguf"))
        if len(found) == 1:
            return str(path), found[0]
        if found:
            raise ValueError(f"{model} holds several GGUF files ({', '.join(found)}): name one")
    return None


def _load_tokenizer(model: str):
    from transformers import PreTrainedTokenizerFast

    quiet_transformers()
    gguf = gguf_location(model)
    if gguf is not None:  # the tokenizer and chat template from the file's metadata
        from llmq.common.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(Path(gguf[0]) / gguf[1])
    if model_file(model, "tokenizer.json") is not None:
        try:
            return PreTrainedTokenizerFast.from_pretrained(model)
        except Exception as exc:  # an unusual tokenizer config: let AutoTokenizer handle it
            log.debug("fast tokenizer load failed for %s: %s", model, exc)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def model_file(model: str, name: str) -> str | None:
    from transformers.utils import cached_file

    try:
        return cached_file(
            model,
            name,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
    except Exception:
        return None
