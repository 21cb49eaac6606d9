"""glibc's malloc tuned for a forward pass's temporaries."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys

log = logging.getLogger(__name__)

_malloc_tuned = False


def tune_malloc() -> None:
    """Keep glibc from returning freed memory to the kernel and mapping it back in every layer.

    A forward pass allocates and frees the same megabyte-sized temporaries (activations, logits)
    over and over. glibc serves big ones with mmap and trims the heap top eagerly, so each reuse
    page-faults its memory back in, zero-filled, which slowed decode steps severalfold
    (docs/performance.md, "Choices: memory"). Fixed thresholds (the largest glibc accepts)
    keep them on the heap, warm."""
    global _malloc_tuned
    if _malloc_tuned or not sys.platform.startswith("linux"):
        return
    _malloc_tuned = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)
        libc.mallopt(m_trim_threshold, 256 << 20)
    except (OSError, AttributeError):  # not glibc
        log.debug("mallopt unavailable; malloc left as it is")


def return_freed_memory() -> None:
    """Give freed memory back to the kernel: pieces under the raised mmap threshold stay in the
    heap, resident, until trimmed. Building a forward frees a layer's float copies at a time
    (fused, packed or quantized): trimming after each layer lowers the build's peak RSS
    (docs/performance.md, "Choices: memory")."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)
