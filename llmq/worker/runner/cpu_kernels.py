"""llmq's CPU kernels (``kernels/*.cpp``), compiled for this machine on first use.

The sources are built with the system's C++ compiler against torch's headers (``-O3
-march=native``: the compiler vectorizes their loops for the CPU it runs on) into a cache
directory keyed by the sources, torch's version, the flags and the CPU's features, so a
machine compiles them once (docs/performance.md, "Choices: CPU kernels") and every later
worker loads the library in milliseconds. Concurrent workers wait on one file lock. Without a
compiler, or when the build fails, ``load`` says why in the log and returns False: the callers
keep their torch paths.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from llmq.common.settings import get_settings

log = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).parent / "kernels"
SOURCES = sorted(KERNELS_DIR.glob("*.cpp"))
HEADERS = sorted(KERNELS_DIR.glob("*.h"))
# -ffp-contract=off: no fused multiply-adds the source does not ask for (torch's float32 ops
# round each product; the kernels that mirror them must too).
FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fopenmp",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-w",
]

_loaded: bool | None = None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmq" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _compile_command(compiler: str, source: Path, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    return [compiler, *FLAGS, *defines, *includes, "-c", str(source), "-o", str(output)]


def _link_command(compiler: str, objects: list[Path], output: Path) -> list[str]:
    torch_lib = Path(torch.__file__).parent / "lib"
    libraries = [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
    return [compiler, *FLAGS, *map(str, objects), *libraries, "-o", str(output)]


def _run_all(commands: list[list[str]]) -> None:
    """Run ``commands`` side by side, one per core at most (each source parses torch's headers
    on its own, so side by side is faster: docs/performance.md); raise on the first that fails."""
    limit = max(1, len(os.sched_getaffinity(0)))
    running: list[subprocess.Popen] = []
    pending = list(commands)
    while pending or running:
        while pending and len(running) < limit:
            running.append(
                subprocess.Popen(pending.pop(0), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
            )
        done = running.pop(0)
        _, err = done.communicate()
        if done.returncode != 0:
            for proc in running:
                proc.kill()
            raise RuntimeError(err.decode(errors="replace").strip()[-2000:] or "compile failed")


def _cpu_features() -> str:
    """What -march=native compiles for: a library built on one CPU may not run on another
    (an AVX-512 build on an AVX2 machine dies of SIGILL), and a cache may be shared (an NFS
    home)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _library_path(cache_dir: Path, compiler: str) -> Path:
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    for part in (torch.__version__, compiler, *FLAGS, sysconfig.get_platform(), _cpu_features()):
        digest.update(part.encode())
    return cache_dir / f"llmq_kernels_{digest.hexdigest()[:16]}.so"


def _build(library: Path, compiler: str) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building the same library
        if library.exists():
            return
        start = time.monotonic()
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
            _run_all(
                [_compile_command(compiler, s, o) for s, o in zip(SOURCES, objects, strict=True)]
            )
            output = Path(tmp) / library.name
            _run_all([_link_command(compiler, objects, output)])
            output.replace(library)  # whole or absent: a crashed build leaves no half library
        log.info("cpu kernels: compiled in %.1f s into %s", time.monotonic() - start, library)


def load(cache_dir: Path | None = None) -> bool:
    """Build (once per machine) and load the kernels; whether ``torch.ops.llmq`` has them."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    compiler = _compiler()
    if compiler is None:
        log.warning("cpu kernels: no C++ compiler (g++) found; torch's attention path serves")
        return False
    try:
        library = _library_path(cache_dir or default_cache_dir(), compiler)
        if not library.exists():
            _build(library, compiler)
        torch.ops.load_library(str(library))
        set_activation_terms(get_settings().int_activations)
    except (OSError, RuntimeError) as exc:
        log.warning("cpu kernels: not built (%s); torch's attention path serves", exc)
        return False
    _loaded = True
    return True


def set_activation_terms(terms: int) -> int:
    """The int8 terms the integer kernels round each block of activations into from now on
    (``LLMQ_INT_ACTIVATIONS``: 1 or 2), and the setting as it was."""
    return int(torch.ops.llmq.set_activation_terms(terms))


def activation_terms() -> int:
    """The int8 terms the integer kernels round each block of activations into (1 or 2)."""
    return int(torch.ops.llmq.activation_terms())
