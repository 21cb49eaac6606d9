"""A GGUF file's tokenizer and chat template, from its metadata, without torch.

transformers builds the tokenizer a GGUF file describes (``gguf_file=``), but its metadata
reader imports torch, which the API process must not. This reads the same keys with the
``gguf`` package's reader (numpy only) and hands them to transformers' converter
(``convert_gguf_tokenizer``), as ``get_gguf_tokenizer`` would.
"""

from __future__ import annotations

from pathlib import Path


def _metadata(path: str | Path) -> dict:
    """The file's metadata values by key (strings decoded, arrays as lists)."""
    try:
        import gguf
    except ImportError as exc:
        raise ImportError("serving a GGUF file needs the gguf package: pip install gguf") from exc
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


def load_gguf_tokenizer(path: str | Path):
    """A ``PreTrainedTokenizerFast`` from the metadata of the GGUF file at ``path``."""
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
