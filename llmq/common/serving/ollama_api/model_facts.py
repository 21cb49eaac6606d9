"""What Ollama's model details tell (family, parameter count, sizes) read from a model's files
where the API can read them without downloading: a local folder, or the Hugging Face cache
that loading its tokenizer filled. Best effort: what cannot be read is left out."""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The bytes of one weight per safetensors dtype (the parameter count from the files' headers).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}


@dataclass(frozen=True)
class ModelFacts:
    family: str = ""
    parameter_count: int = 0
    size_bytes: int = 0
    config: dict[str, Any] = field(default_factory=dict)


def _config_path(source: str) -> Path | None:
    folder = Path(source)
    if folder.is_dir():
        path = folder / "config.json"
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, "config.json")
    except Exception:  # not a hub id, or no cache
        return None
    return Path(found) if isinstance(found, str) else None


def _header_parameters(path: Path) -> int:
    """The parameters one safetensors file holds, from its header alone."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100_000_000:
            return 0
        header = json.loads(f.read(length))
    count = 0
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        n = 1
        for dim in entry.get("shape", []):
            n *= int(dim)
        count += n
    return count


@functools.lru_cache(maxsize=32)
def model_facts(source: str) -> ModelFacts:
    """The facts of the model at ``source`` (a folder or a hub id); empty where unreadable."""
    config_path = _config_path(source)
    if config_path is None:
        return ModelFacts()
    try:
        config = json.loads(config_path.read_text())
        weights = sorted(config_path.parent.glob("*.safetensors"))
        parameters = sum(_header_parameters(p) for p in weights)
        size = sum(p.stat().st_size for p in weights)
    except (OSError, ValueError, struct.error):
        return ModelFacts()
    return ModelFacts(str(config.get("model_type", "")), parameters, size, config)


def parameter_size(count: int) -> str:
    """Ollama's way to write a parameter count: "135.0M", "7.6B" ("" when unknown)."""
    if count <= 0:
        return ""
    if count >= 1_000_000_000:
        return f"{count / 1e9:.1f}B"
    return f"{count / 1e6:.1f}M"


def quantization_level(dtype: str) -> str:
    """The worker's weights dtype as Ollama names a level (F32, BF16, F16)."""
    names = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    return names.get(dtype.removeprefix("torch."), dtype.upper())
